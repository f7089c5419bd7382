"""The paged KV cache: fixed-size blocks from one pool, a block table per sequence, shared blocks
with reference counts, and copy-on-write (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023).

Layout: K and V are each (n_layers, num_blocks, block_size, n_kv_heads, head_dim). Sequence s
keeps its token t at block `tables[s][t // block_size]`, slot `t % block_size`. With prefix
sharing on, a full block is known by a sha256 digest of its tokens chained with its prefix's
digest, as in vLLM's automatic prefix caching: a new sequence whose prompt starts with cached
blocks takes them instead of computing them, and a freed block stays cached until the pool needs
it back. A sequence hands its blocks back last block first, so the pool evicts a chain from its
tail and the prefix that other prompts share outlives it.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from infra_lab.kernels.paged_shapes import blocks_in_use
from infra_lab.kv import metadata
from infra_lab.kv.metadata import StepMetadata

ROOT_DIGEST = bytes(32)  # the parent of every sequence's first block


def chain_digest(parent: bytes, tokens) -> bytes:
    """A full block's name: sha256 over its parent block's digest and its token ids (int64,
    little-endian). Python's hash would let two prefixes share KV (hash(-1) == hash(-2)); vLLM
    moved to sha256 after advisory GHSA-rm76-4mrf-v9r8 (an option from v0.8.3, the default from
    v0.10.2)."""
    return hashlib.sha256(parent + np.asarray(tokens, "<i8").tobytes()).digest()


@dataclass(frozen=True)
class SequenceKV:
    """One sequence's K and V out of a pool, as plain arrays (numpy, host memory) with their
    layout: what moves a request's cache to another pool, in this process or another."""
    data: np.ndarray  # (n_layers, 2, tokens, n_kv_heads, head_dim): K then V, position by position
    tokens: tuple[int, ...]  # the tokens whose K and V they are

    @property
    def layout(self) -> dict:
        n_layers, _, _, n_kv_heads, head_dim = self.data.shape
        return {"n_layers": n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "dtype": str(self.data.dtype)}

    @property
    def nbytes(self) -> int:
        """2 x layers x KV heads x head dim x tokens x bytes per element."""
        return self.data.nbytes


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
        self.cached: OrderedDict[int, bytes] = OrderedDict()  # block -> digest, least recently freed first
        self.evicted: list[bytes] = []  # digests dropped by the last allocate, for the cache's index

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
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is outside the pool of {self.num_blocks}")
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not allocated; share only live blocks")
        self.ref_counts[block] += 1

    def revive(self, block: int) -> None:
        """Take a cached block back into use (a prefix hit on a freed block)."""
        if block not in self.cached:
            raise ValueError(f"block {block} is not cached")
        del self.cached[block]
        self.ref_counts[block] = 1

    def free(self, block: int, keep_as: bytes | None = None) -> None:
        """Drop one reference; at zero the block is free again, or cached under digest `keep_as`."""
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
        self.digests: dict[int, list[bytes]] = {}  # seq -> chain digest of each of its full blocks
        self.hash_to_block: dict[bytes, int] = {}  # the prefix index: chain digest -> block
        self.block_hash: dict[int, bytes] = {}  # registered block -> its chain digest
        self.block_tokens: dict[int, tuple[int, ...]] = {}  # registered block -> its tokens, checked on a hit
        self._next_id = 0

    # ---- sequences -----------------------------------------------------------------------

    def _live(self, seq: int) -> None:
        if seq not in self.tables:
            raise KeyError(f"sequence {seq} is not live (never created, or freed); live: {sorted(self.tables)}")

    def new_sequence(self) -> int:
        seq, self._next_id = self._next_id, self._next_id + 1
        self.tables[seq], self.lengths[seq], self.tokens[seq], self.digests[seq] = [], 0, [], []
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of `seq` (parallel sampling, beam search)."""
        self._live(seq)
        child = self.new_sequence()
        for block in self.tables[seq]:
            self.allocator.incref(block)
        self.tables[child] = list(self.tables[seq])
        self.lengths[child], self.tokens[child] = self.lengths[seq], list(self.tokens[seq])
        self.digests[child] = list(self.digests[seq])
        return child

    def free(self, seq: int) -> None:
        """Return the sequence's blocks, last block first: a chain's tail is then evicted before
        its head, whose prefix more prompts share. Shared blocks stay with their other owners."""
        self._live(seq)
        for block in reversed(self.tables.pop(seq)):
            self._release(block, keep=self.prefix_sharing)
        del self.lengths[seq], self.tokens[seq], self.digests[seq]

    def truncate(self, seq: int, length: int) -> None:
        """Roll `seq` back to its first `length` tokens (speculative decoding drops the rejected
        draft tokens). Blocks past the new end go back, forgotten by the prefix index unless other
        sequences hold them; a partly kept block is written again from `length` on, so it leaves
        the index now if it is this sequence's alone (`reserve` copies it if it is shared)."""
        self._live(seq)
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot truncate sequence {seq} to {length} tokens; "
                             f"allowed 0..{self.lengths[seq]} (its length)")
        table, kept = self.tables[seq], -(-length // self.block_size)
        for block in reversed(table[kept:]):
            self._release(block, keep=False)
        del table[kept:]
        if length % self.block_size and self.allocator.ref_counts[table[-1]] == 1:
            self._forget(table[-1])
        self.lengths[seq] = length
        del self.tokens[seq][length:], self.digests[seq][length // self.block_size:]

    def _release(self, block: int, keep: bool) -> None:
        """Drop one reference; a block no one holds stays cached if `keep` and it is registered."""
        digest = self.block_hash.get(block) if keep else None
        self.allocator.free(block, keep_as=digest)
        if self.allocator.ref_counts[block] == 0 and digest is None:
            self._forget(block)

    def _forget(self, block: int) -> None:
        """Take the block out of the prefix index (a no-op for a block that is not in it)."""
        old = self.block_hash.pop(block, None)
        self.block_tokens.pop(block, None)
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
        table = self.tables[seq]
        if needed == 0 and (not table or table[-1] not in self.block_hash):
            return  # room already (a decode inside its last block): nothing to take or forget
        blocks = self.allocator.allocate(needed)
        for old_digest in self.allocator.evicted:
            self._forget(self.hash_to_block[old_digest])
        table, length = self.tables[seq], self.lengths[seq]
        if length % self.block_size and n_new > 0:
            if self.allocator.ref_counts[table[-1]] > 1:
                private = blocks.pop()  # copy-on-write
                self.kv[:, private] = self.kv[:, table[-1]]  # K and V in one copy
                self.allocator.free(table[-1])
                table[-1] = private
            else:  # ours alone, but still indexed if a truncate left it partly kept while shared
                self._forget(table[-1])
        table.extend(blocks)

    def write(self, seq: int, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store keys and values (T, n_kv_heads, head_dim) for the next T positions."""
        start = self.lengths[seq]
        self.store(layer, self.slots(seq, start, start + k.shape[0]), k, v)

    def slots(self, seq: int, start: int, end: int) -> np.ndarray:
        """(end - start,) the slots (block * block_size + offset) of positions start .. end - 1."""
        where = np.arange(start, end)
        return np.asarray(self.tables[seq], np.int64)[where // self.block_size] * self.block_size + where % self.block_size

    def store(self, layer: int, slots, k, v) -> None:
        """Write keys and values (T, n_kv_heads, head_dim) at `slots` (T,): one scatter each, numpy
        arrays or torch tensors alike. The model calls this; a cache that keeps a format of its
        own (kv.quant) overrides it."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.k[layer, blocks, offsets] = k
        self.v[layer, blocks, offsets] = v

    def commit(self, seq: int, tokens) -> None:
        """The positions just written now hold `tokens`; blocks they fill get their chain digest,
        each from its parent's, and enter the prefix index unless it knows that digest already."""
        before = self.lengths[seq]
        self.tokens[seq].extend(int(t) for t in tokens)
        self.lengths[seq] = before + len(tokens)
        if self.prefix_sharing:
            for index in range(before // self.block_size, self.lengths[seq] // self.block_size):
                self._register(seq, index)

    def _register(self, seq: int, index: int) -> None:
        chunk = tuple(self.tokens[seq][index * self.block_size:(index + 1) * self.block_size])
        digests = self.digests[seq]  # one per full block before this one
        digest = chain_digest(digests[index - 1] if index else ROOT_DIGEST, chunk)
        digests.append(digest)
        block = self.tables[seq][index]
        if block not in self.block_hash and digest not in self.hash_to_block:
            self.block_hash[block], self.hash_to_block[digest] = digest, block
            self.block_tokens[block] = chunk

    def peek_prefix(self, tokens) -> int:
        """How many of `tokens`' leading tokens whole cached blocks hold, without taking them
        (match_prefix would take as many for tokens one longer: it leaves the last one out)."""
        if not self.prefix_sharing:
            return 0
        tokens, digest, matched = [int(t) for t in tokens], ROOT_DIGEST, 0
        while (matched + 1) * self.block_size <= len(tokens):
            chunk = tuple(tokens[matched * self.block_size:(matched + 1) * self.block_size])
            digest = chain_digest(digest, chunk)
            block = self.hash_to_block.get(digest)
            if block is None or self.block_tokens[block] != chunk:
                break
            matched += 1
        return matched * self.block_size

    def forget_prefixes(self) -> None:
        """Empty the prefix index: no block is found by its tokens any more, and blocks kept only
        for it are free (new weights make their K and V wrong). Live sequences keep their blocks."""
        self.hash_to_block.clear(), self.block_hash.clear(), self.block_tokens.clear()
        while self.allocator.cached:
            self.allocator.free_ids.append(self.allocator.cached.popitem(last=False)[0])

    def match_prefix(self, seq: int, tokens) -> int:
        """For a new, empty sequence: take the cached full blocks that its first tokens match;
        return how many tokens they cover (the caller computes only the rest)."""
        self._live(seq)
        if self.lengths[seq]:
            raise ValueError(f"sequence {seq} already holds {self.lengths[seq]} tokens; match a prefix first")
        if not self.prefix_sharing:
            return 0
        tokens = [int(t) for t in tokens]
        digests, matched = self.digests[seq], 0
        while (matched + 1) * self.block_size <= len(tokens) - 1:  # keep one token to compute logits from
            chunk = tuple(tokens[matched * self.block_size:(matched + 1) * self.block_size])
            digest = chain_digest(digests[-1] if digests else ROOT_DIGEST, chunk)
            block = self.hash_to_block.get(digest)
            if block is None or self.block_tokens[block] != chunk:  # the tokens too: belt and braces
                break
            if self.allocator.ref_counts[block] == 0:
                self.allocator.revive(block)
            else:
                self.allocator.incref(block)
            self.tables[seq].append(block)
            digests.append(digest)
            matched += 1
        self.lengths[seq] = matched * self.block_size
        self.tokens[seq] = tokens[: self.lengths[seq]]
        return self.lengths[seq]

    def reserve_all(self, seqs: list[int], n_new: list[int]) -> None:
        """`reserve` for several sequences, all or nothing: OutOfBlocks, and nothing changes, when
        the pool cannot cover them together."""
        if len(seqs) != len(n_new) or len(set(seqs)) != len(seqs):
            raise ValueError(f"need distinct sequences, one count each; got {seqs} and {n_new}")
        needs = [self.blocks_needed(seq, n) for seq, n in zip(seqs, n_new)]
        if sum(needs) > self.allocator.num_free:
            raise OutOfBlocks(f"need {sum(needs)} blocks for {len(seqs)} sequences but only "
                              f"{self.allocator.num_free} of {self.allocator.num_blocks} are free")
        for seq, n, need in zip(seqs, n_new, needs):
            if need or self.block_hash:  # a sequence with room already needs nothing (the engine's decodes)
                self.reserve(seq, n)

    def attach_prefix(self, seq: int, blocks, tokens) -> None:
        """Start an empty sequence with blocks that already hold `tokens`' keys and values (a
        radix-tree hit): it takes a reference to each, as a prefix match does."""
        self._live(seq)
        blocks, tokens = [int(b) for b in blocks], [int(t) for t in tokens]
        if self.lengths[seq]:
            raise ValueError(f"sequence {seq} already holds {self.lengths[seq]} tokens; attach a prefix first")
        if self.prefix_sharing:
            raise ValueError("this pool finds shared prefixes itself (prefix_sharing=True): use match_prefix")
        if len(blocks) != -(-len(tokens) // self.block_size):
            raise ValueError(f"{len(tokens)} tokens fill {-(-len(tokens) // self.block_size)} blocks of "
                             f"{self.block_size}; got {len(blocks)} blocks")
        dead = [b for b in blocks if not 0 <= b < self.allocator.num_blocks or self.allocator.ref_counts[b] == 0]
        if dead:
            raise ValueError(f"block {dead[0]} is not allocated: a prefix must be held (by a tree, say)")
        self.hold(blocks)
        self.tables[seq], self.lengths[seq], self.tokens[seq] = list(blocks), len(tokens), tokens

    def hold(self, blocks) -> None:
        """One more reference to each of `blocks`, for an owner outside the tables (a radix tree)."""
        for block in blocks:
            self.allocator.incref(int(block))

    def release(self, blocks) -> None:
        """Drop a reference `hold` took; a block no one holds is free again."""
        for block in blocks:
            self._release(int(block), keep=False)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    # ---- one step's metadata -------------------------------------------------------------------

    def step_metadata(self, seqs: list[int], n_new: list[int]) -> StepMetadata:
        """The metadata of a step in which each of `seqs` adds n_new[b] tokens after what it
        holds (`reserve` must have made room)."""
        for seq, n in zip(seqs, n_new):
            self._live(seq)
            if self.lengths[seq] + n > len(self.tables[seq]) * self.block_size:
                raise ValueError(f"sequence {seq} holds {self.lengths[seq]} tokens in {len(self.tables[seq])} "
                                 f"blocks of {self.block_size}: reserve room for {n} more first")
        return metadata.build([self.tables[seq] for seq in seqs], [self.lengths[seq] for seq in seqs], n_new,
                              self.block_size)

    def check_step(self, meta: StepMetadata) -> None:
        """Raise ValueError unless `meta` fits this pool: its arrays agree, and every block its
        tables use is allocated (the model checks this once per step, before writing)."""
        if meta.block_size != self.block_size:
            raise ValueError(f"the metadata's block_size is {meta.block_size}; this pool's is {self.block_size}")
        meta.check(self.allocator.num_blocks)
        in_use = meta.block_tables[blocks_in_use(meta.block_tables, meta.context_lens, self.block_size)]
        ref_counts = self.allocator.ref_counts
        unallocated = [block for block in in_use.tolist() if ref_counts[block] == 0]
        if unallocated:
            raise ValueError(f"block {unallocated[0]} is in a block table but not allocated")

    @contextmanager
    def undo_on_error(self, seqs: list[int]):
        """If the block inside fails, hand back what it reserved: each of `seqs` keeps the tokens
        it held when the block began."""
        lengths = [self.lengths[seq] for seq in seqs]
        try:
            yield
        except Exception:
            for seq, length in zip(seqs, lengths):
                self.truncate(seq, length)
            raise

    # ---- reading -----------------------------------------------------------------------------

    def gather(self, seq: int, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `length` positions of K and V, contiguous: (length, n_kv_heads, head_dim)."""
        table = list(self.tables[seq][: -(-length // self.block_size)])
        shape = (-1,) + tuple(self.k.shape[3:])
        return self.k[layer, table].reshape(shape)[:length], self.v[layer, table].reshape(shape)[:length]

    def export_sequence(self, seq: int) -> SequenceKV:
        """A copy of `seq`'s K and V (the tokens it holds), in host memory, in pool-free layout."""
        self._live(seq)
        length, table = self.lengths[seq], self.tables[seq]
        blocks = self.kv[:, _index(table, self.kv)]  # (L, blocks, 2, block_size, K, Dh)
        data = blocks.transpose(1, 2) if not isinstance(blocks, np.ndarray) else blocks.swapaxes(1, 2)
        data = data.reshape(data.shape[0], 2, -1, *data.shape[4:])[:, :, :length]  # (L, 2, tokens, K, Dh)
        data = np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data.contiguous().cpu().numpy()
        return SequenceKV(data, tuple(self.tokens[seq]))

    def check_import(self, kv: SequenceKV) -> None:
        """ValueError unless `kv` has this pool's layout (layers, KV heads, head size, dtype)."""
        mine = {"n_layers": self.kv.shape[0], "n_kv_heads": self.kv.shape[4], "head_dim": self.kv.shape[5],
                "dtype": str(self.kv.dtype).removeprefix("torch.")}
        if not isinstance(kv, SequenceKV) or kv.data.ndim != 5 or kv.data.shape[1:3] != (2, len(kv.tokens)):
            raise ValueError("K and V to import are a SequenceKV of shape (n_layers, 2, tokens, kv_heads, head_dim)")
        theirs = kv.layout
        if theirs != mine:
            differ = {k: (theirs[k], mine[k]) for k in mine if theirs[k] != mine[k]}
            raise ValueError(f"K and V for {len(kv.tokens)} tokens do not fit this pool: (theirs, this pool's) {differ}")

    def import_sequence(self, kv: SequenceKV) -> int:
        """A new sequence holding `kv`'s K and V, in blocks of this pool's size (whatever the
        exporting pool's were). Raises ValueError if the layout differs from this pool's, and
        OutOfBlocks if the pool is short; either way nothing changes."""
        self.check_import(kv)
        n = -(-len(kv.tokens) // self.block_size)
        blocks = self.allocator.allocate(n)  # OutOfBlocks before anything changes
        padded = np.zeros((kv.data.shape[0], 2, n * self.block_size, *kv.data.shape[3:]), kv.data.dtype)
        padded[:, :, :len(kv.tokens)] = kv.data
        data = padded.reshape(kv.data.shape[0], 2, n, self.block_size, *kv.data.shape[3:]).swapaxes(1, 2)
        if not isinstance(self.kv, np.ndarray):
            import torch

            data = torch.from_numpy(np.ascontiguousarray(data)).to(self.kv.device)
        self.kv[:, _index(blocks, self.kv)] = data
        seq = self.new_sequence()
        self.tables[seq], self.lengths[seq], self.tokens[seq] = blocks, len(kv.tokens), list(kv.tokens)
        return seq

    def view(self, seq: int) -> SequenceView:
        self._live(seq)
        return SequenceView(self, seq)

    @property
    def bytes_per_block(self) -> int:
        return self.kv[:, 0].nbytes  # K and V; numpy arrays and torch tensors both have nbytes


def _index(blocks, like):
    """Block ids to index `like` (a numpy array, or a torch tensor on its device)."""
    if isinstance(like, np.ndarray):
        return np.asarray(blocks, np.int64)
    import torch

    return torch.as_tensor(list(blocks), dtype=torch.int64, device=like.device)


class SequenceView:
    """One sequence of a PagedKVCache, as the model's forward takes a cache: its pool and id.
    The model writes through `store` and reads the pool through `k`, `v` and the step's tables."""

    def __init__(self, cache: PagedKVCache, seq: int):
        self.cache, self.seq = cache, seq

    @property
    def length(self) -> int:
        return self.cache.lengths[self.seq]

    @property
    def k(self):
        return self.cache.k

    @property
    def v(self):
        return self.cache.v

    def store(self, layer: int, slots, k, v) -> None:
        self.cache.store(layer, slots, k, v)

    def check_step(self, meta: StepMetadata) -> None:
        self.cache.check_step(meta)
