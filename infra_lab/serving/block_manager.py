"""The scheduler's view of KV memory: how many blocks a request's next tokens need, where a new
request starts (after a cached prefix, with the radix cache), and what preemption frees.

It is the only part of the engine that changes the pool's books (tables, lengths, references): it
reserves room before a step, records what the step computed after it, forks an n > 1 request's
samples from their prompt, and hands blocks back; the model runner only fills the slots. With the
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
    def __init__(self, pool: PagedKVCache, radix: bool = False, host_blocks: int = 0,
                 tree: RadixCache | None = None):
        """Books for `pool`; with `radix`, through a radix tree (`tree`, an empty one of the
        caller's, or a new one), which holds one reference to each slot it caches."""
        if radix and pool.block_size != 1:
            raise ValueError(f"the radix cache needs a pool of one-token blocks; got block_size {pool.block_size}")
        if tree is not None and (not radix or tree.total_size):
            raise ValueError("tree must be an empty RadixCache, with radix=True: a tree's slots belong to the pool "
                             f"it was filled from (got radix={radix}, {tree.total_size} tokens cached)")
        self.pool = pool
        self.tree = (tree or RadixCache()) if radix else None
        if self.tree is not None:
            self.tree.free_slots = pool.release
        self.host = HostPool(pool, host_blocks) if host_blocks else None
        self.locked: dict[int, Node] = {}  # request id -> the tree node its cached prefix ends at
        self.swapped: dict[int, SwappedSequence] = {}  # request id -> its blocks in host memory
        self.stale_trees: list[RadixCache] = []  # trees flushed by a weight update, emptied as their locks go
        self.forks = 0  # samples started from another sample's blocks
        self.evicted_tokens = 0  # cached tokens the tree let go of to make room

    def reserve(self, request: Request, n_tokens: int) -> None:
        """Room in the request's blocks for its next `n_tokens` (OutOfBlocks, nothing changed, if short)."""
        self.pool.reserve(request.seq, n_tokens)

    def record(self, request: Request, computed: list[int], kept: int) -> None:
        """After a step: the first `kept` of the `computed` tokens (whose K and V it wrote) now
        stand in the request's sequence; room reserved past them (rejected or unmade drafts) goes back."""
        pool, seq = self.pool, request.seq
        pool.commit(seq, computed[:kept])
        if len(pool.tables[seq]) * self.block_size - pool.lengths[seq] >= self.block_size:
            pool.truncate(seq, pool.lengths[seq])

    def fork(self, parent: Request, child: Request) -> None:
        """Start `child` (a sample of the same prompt) on every block of `parent`, which has just
        computed the prompt: the blocks are shared, and a shared last block is copied on its first
        write (copy-on-write)."""
        child.seq, child.num_computed = self.pool.fork(parent.seq), parent.num_computed
        if self.tree:
            node = self.locked[parent.request_id]
            node_tree = self._tree_of(node)
            node_tree.lock(node)
            self.locked[child.request_id] = node
        self.forks += 1

    def adopt(self, request: Request, kv) -> None:
        """Give an imported request a sequence holding its exported K and V (kv.paged.SequenceKV)."""
        self.pool.check_import(kv)
        if not self.make_room(-(-len(kv.tokens) // self.block_size)):
            raise OutOfBlocks(f"request {request.request_id} brings {len(kv.tokens)} tokens of K and V; "
                              f"{self.available} blocks of {self.block_size} can be had")
        request.seq, request.num_computed = self.pool.import_sequence(kv), len(kv.tokens)
        if self.tree:  # a root "lock", so release() finds one
            self.locked[request.request_id] = self.tree.root

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix (new weights make their K and V wrong). Prefixes that running
        requests hold stay theirs, and leave with them; no new request will match them."""
        self.pool.forget_prefixes()
        if not self.tree:
            return
        old = self.tree
        old.evict(old.evictable_size)
        self.tree = RadixCache(free_slots=self.pool.release)
        if any(node is not old.root for node in self.locked.values()):
            self.stale_trees.append(old)
        for request_id, node in self.locked.items():  # a root "lock" moves to the new root
            if node is old.root:
                self.locked[request_id] = self.tree.root

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

    @property
    def prefix_index(self):
        """What finds cached prefixes (peek_prefix(tokens) -> tokens held): the tree, the pool's
        block hashes, or None."""
        return self.tree or (self.pool if self.pool.prefix_sharing else None)

    def cached_prefix(self, request: Request) -> int:
        """Tokens of `request` the cache holds (at most all but its last: one must run for logits)."""
        index = self.prefix_index
        return index.peek_prefix(request.tokens[:-1]) if index is not None else 0

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
        self.evicted_tokens += self.tree.evict(n_blocks - self.pool.num_free)
        return self.pool.num_free >= n_blocks

    def start(self, request: Request) -> int:
        """Give a request a sequence in the pool, after its cached prefix (locked against eviction);
        return how many tokens the cache served. An admission that fails is undone by `release`."""
        seq = self.pool.new_sequence()
        matched = self.pool.match_prefix(seq, request.tokens)  # whole blocks the hash index holds (0 without)
        if self.tree:
            matched, slots, node = self.tree.match_prefix(request.tokens[:-1])
            self.tree.lock(node)
            self.locked[request.request_id] = node
            self.pool.attach_prefix(seq, slots, request.tokens[:matched])
        request.seq, request.num_computed = seq, matched
        return matched  # the scheduler counts it in request.cached_tokens once the request is admitted

    def release(self, request: Request) -> None:
        """Hand back a request's blocks (finished, aborted, or preempted to recompute). With the tree,
        what it computed is cached first, so a later request, or its own rerun, starts after it
        (unless its prefix came from a tree that a weight update flushed: then nothing is cached)."""
        if request.seq is None:
            return
        if self.tree:
            node = self.locked.pop(request.request_id)
            tree = self._tree_of(node)
            if tree is self.tree:
                tokens = self.pool.tokens[request.seq]  # the tokens whose K and V are in the pool
                slots = np.asarray(self.pool.tables[request.seq], np.int64)  # one token per block
                _, cached, _ = self.tree.match_prefix(tokens)  # slots the tree holds for its first tokens
                new = np.arange(len(slots)) >= len(cached)
                new[:len(cached)] = slots[:len(cached)] != cached  # (a sample's prompt may be there already)
                self.pool.hold(slots[new])  # the tree's reference to the slots it does not hold yet
                self.tree.insert(tokens, slots)  # keeps them, or hands back duplicates
            self._unlock(node)
        self.pool.free(request.seq)
        request.seq, request.num_computed = None, 0

    def _unlock(self, node: Node) -> None:
        """Unpin a request's prefix; a flushed tree gives back what no request pins any more."""
        tree = self._tree_of(node)
        tree.unlock(node)
        if tree is not self.tree:
            tree.evict(tree.evictable_size)
            if not any(self._tree_of(n) is tree for n in self.locked.values()):
                self.stale_trees.remove(tree)

    def _tree_of(self, node: Node) -> RadixCache:
        root = node
        while root.parent is not None:
            root = root.parent
        return next(tree for tree in [self.tree, *self.stale_trees] if tree.root is root)

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
            self._unlock(self.locked.pop(request.request_id))
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

