"""The scheduler's view of KV memory: how many blocks a request's next tokens need, where a new
request starts (after a cached prefix, with the radix cache), and what preemption frees.

It owns the pool's bookkeeping for requests; the model runner only fills the blocks. With the
radix cache (chapter 04) the pool has blocks of one token and the tree holds one reference to
each slot it caches: a finished or preempted request inserts what it computed, a new one
starts after its longest cached prefix, and the tree's unlocked leaves are evicted (least
recently used first) before any request is preempted. With swap space, a preempted request's
blocks go to host memory (kv.host) instead of being dropped.
"""
from __future__ import annotations

import numpy as np

from infra_lab.kv.host import HostPool, SwappedSequence
from infra_lab.kv.paged import OutOfBlocks, PagedKVCache
from infra_lab.kv.radix import Node, RadixCache
from infra_lab.serving.request import Request


class BlockManager:
    def __init__(self, pool: PagedKVCache, radix: bool = False, host_blocks: int = 0):
        if radix and pool.block_size != 1:
            raise ValueError(f"the radix cache needs a pool of one-token blocks; got block_size {pool.block_size}")
        self.pool = pool
        self.tree = RadixCache(free_slots=pool.release) if radix else None
        self.host = HostPool(pool, host_blocks) if host_blocks else None
        self.locked: dict[int, Node] = {}  # request id -> the tree node its cached prefix ends at
        self.swapped: dict[int, SwappedSequence] = {}  # request id -> its blocks in host memory

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.pool.allocator.num_blocks * self.pool.block_size

    @property
    def available(self) -> int:
        """Blocks a request could get now: free ones, and those the tree could evict."""
        return self.pool.num_free + (self.tree.evictable_size if self.tree else 0)

    def cached_prefix(self, request: Request) -> int:
        """Tokens of `request` the tree holds (at most all but its last: one must run for logits)."""
        return self.tree.peek_prefix(request.tokens[:-1]) if self.tree else 0

    def blocks_needed(self, request: Request, n_new: int) -> int:
        """Blocks the request's next `n_new` tokens take (a request not started yet starts after
        its cached prefix)."""
        if request.seq is not None:
            return self.pool.blocks_needed(request.seq, n_new)
        cached = self.cached_prefix(request)  # whole blocks it will share (one-token blocks with the tree)
        return -(-(cached + n_new) // self.block_size) - cached // self.block_size

    def make_room(self, n_blocks: int) -> bool:
        """Evict cached prefixes until `n_blocks` are free; False (evicting nothing) if they cannot be."""
        if self.pool.num_free >= n_blocks:
            return True
        if n_blocks > self.available:
            return False
        self.tree.evict(n_blocks - self.pool.num_free)
        return self.pool.num_free >= n_blocks

    def start(self, request: Request) -> int:
        """Give a request a sequence in the pool, after its cached prefix (locked against eviction);
        return how many tokens the cache served. An admission that fails is undone by `release`."""
        seq = self.pool.new_sequence()
        matched = 0
        if self.tree:
            matched, slots, node = self.tree.match_prefix(request.tokens[:-1])
            self.tree.lock(node)
            self.locked[request.request_id] = node
            self.pool.attach_prefix(seq, slots, request.tokens[:matched])
        request.seq, request.num_computed = seq, matched
        return matched  # the scheduler counts it in request.cached_tokens once the request is admitted

    def release(self, request: Request) -> None:
        """Hand back a request's blocks (finished, aborted, or preempted to recompute). With the tree,
        what it computed is cached first, so a later request, or its own rerun, starts after it."""
        if request.seq is None:
            return
        if self.tree:
            tokens = self.pool.tokens[request.seq]  # the tokens whose K and V are in the pool
            slots = np.asarray(self.pool.tables[request.seq], np.int64)  # one token per block
            node = self.locked.pop(request.request_id)
            attached = self._path_length(node)
            self.pool.hold(slots[attached:])  # the tree's reference to the slots it did not hand out
            self.tree.insert(tokens, slots)  # keeps them, or hands back duplicates
            self.tree.unlock(node)
        self.pool.free(request.seq)
        request.seq, request.num_computed = None, 0

    def unreserve(self, request: Request) -> None:
        """Hand back blocks reserved for tokens that were planned but will not run (the request was
        preempted in the step that planned them): its table again covers only what it computed."""
        self.pool.truncate(request.seq, self.pool.lengths[request.seq])

    def can_swap_out(self, request: Request) -> bool:
        return (self.host is not None and request.seq is not None
                and self.host.blocks_of(request.seq) <= self.host.num_free)

    def swap_out(self, request: Request) -> None:
        """Move a running request's blocks to host memory; it keeps what it computed."""
        if self.tree:  # its prefix slots are copied with the rest; the tree may evict the originals
            self.tree.unlock(self.locked.pop(request.request_id))
        self.swapped[request.request_id] = self.host.swap_out(request.seq)
        request.seq = None

    def swap_in_blocks(self, request: Request, n_new: int) -> int:
        """Blocks a swapped request takes to come back and compute its next `n_new` tokens: its
        swapped blocks, and any more that those tokens spill into."""
        swapped = self.swapped[request.request_id]
        return max(len(swapped.host_blocks), -(-(len(swapped.tokens) + n_new) // self.block_size))

    def swap_in(self, request: Request) -> None:
        swapped = self.swapped[request.request_id]
        if not self.make_room(len(swapped.host_blocks)):
            raise OutOfBlocks(f"request {request.request_id} needs {len(swapped.host_blocks)} blocks to swap in; "
                              f"{self.pool.num_free} are free")
        request.seq = self.host.swap_in(swapped)
        del self.swapped[request.request_id]
        if self.tree:  # a root "lock", so release() finds one
            self.locked[request.request_id] = self.tree.root

    def drop(self, request: Request) -> None:
        """Forget an aborted request's blocks, in the pool or in host memory."""
        if request.request_id in self.swapped:
            self.host.drop(self.swapped.pop(request.request_id))
        self.release(request)

    def _path_length(self, node: Node) -> int:
        length = 0
        while node is not self.tree.root:
            length, node = length + len(node.key), node.parent
        return length
