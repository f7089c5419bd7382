"""Checks for chapter 03's exercises: a block allocator, appending through a block table, copy
on write, and gathering a sequence's K/V. The stateful ones are driven through seeded random
operation sequences, and every observable result is compared with the reference's.

The references are small functions of plain tables and arrays, as the exercises ask; the
package's paged cache (`infra_lab.kv.paged`) does the same work through its own tables, and
tests/test_grading_ch03_references.py runs each reference beside it: Allocator beside
BlockAllocator, append_token and cow_append beside PagedKVCache.reserve (and fork), gather_kv
beside PagedKVCache.gather. The one intended difference: Allocator hands out the smallest free
block (the exercise's contract, so a student's choice of block is graded), where BlockAllocator
hands out free blocks first in, first out."""
from __future__ import annotations

import heapq

import numpy as np

from infra_lab.grading.checks import Check, register
from infra_lab.kv.paged import OutOfBlocks


class Allocator:
    """Reference: blocks 0..num_blocks-1; allocate() hands out the smallest free id with
    reference count 1, share(b) adds a reference, free(b) drops one; OutOfBlocks (a
    RuntimeError) when none is free, ValueError when sharing or freeing a free block."""

    def __init__(self, num_blocks):
        self.free_ids = list(range(num_blocks))  # a heap, so the smallest free id comes first
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self):
        return len(self.free_ids)

    def allocate(self):
        if not self.free_ids:
            raise OutOfBlocks(f"all {len(self.ref_counts)} blocks are in use")
        block = heapq.heappop(self.free_ids)
        self.ref_counts[block] = 1
        return block

    def share(self, block):
        if self._ref_count(block) == 0:
            raise ValueError(f"block {block} is free; share only allocated blocks")
        self.ref_counts[block] += 1

    def free(self, block):
        if self._ref_count(block) == 0:
            raise ValueError(f"block {block} is already free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            heapq.heappush(self.free_ids, block)

    def _ref_count(self, block):
        if not 0 <= block < len(self.ref_counts):
            raise ValueError(f"block {block} is outside the pool: blocks are 0..{len(self.ref_counts) - 1}")
        return self.ref_counts[block]


def _error_kind(error: Exception) -> str:
    """What the allocator check compares for a failed call: the exercise's two error types, so
    OutOfBlocks and a student's own RuntimeError both read as RuntimeError."""
    return "RuntimeError" if isinstance(error, RuntimeError) else "ValueError"


def drive_allocator(cls, num_blocks, ops):
    """Run (op, argument) pairs on cls(num_blocks); record each result or the kind of error."""
    allocator, log = cls(num_blocks), []
    for op, argument in ops:
        try:
            if op == "allocate":
                log.append(("allocate", allocator.allocate()))
            elif op == "share":
                allocator.share(argument % num_blocks)
                log.append(("share", None))
            else:
                allocator.free(argument % num_blocks)
                log.append(("free", None))
        except (RuntimeError, ValueError) as error:
            log.append((op, _error_kind(error)))
        log.append(("num_free", allocator.num_free))
    return log


def append_token(table, length, block_size, allocate):
    """Reference: where token number `length` goes. When the sequence's blocks are full (or it
    has none), take a new block from allocate() and add it to `table`. Returns (block, slot)."""
    if length == len(table) * block_size:
        table.append(allocate())
    return table[length // block_size], length % block_size


def drive_append(function, block_size, n_tokens):
    counter, table, places = iter(range(100, 10_000, 7)), [], []
    for length in range(n_tokens):
        places.append(function(table, length, block_size, lambda: next(counter)))
    return places, table


def cow_append(table, length, block_size, ref_counts, allocate, copy_block):
    """Reference: like append_token, but if the token goes into a last block that other tables
    share (reference count > 1), first give this table its own copy: allocate a block,
    copy_block(old, new), drop one reference to the old block. Returns (block, slot)."""
    if length == len(table) * block_size:
        table.append(allocate())
    elif ref_counts[table[-1]] > 1:
        new = allocate()
        copy_block(table[-1], new)
        ref_counts[table[-1]] -= 1
        table[-1] = new
    return table[length // block_size], length % block_size


def drive_cow(function, block_size, script):
    """Sequences that append and fork; the log records every slot, allocation and copy."""
    ref_counts: dict[int, int] = {}
    next_block = iter(range(1000))
    log = []

    def allocate():
        block = next(next_block)
        ref_counts[block] = 1
        log.append(("allocate", block))
        return block

    sequences = [([], 0)]
    for step, pick in script:
        index = pick % len(sequences)
        table, length = sequences[index]
        if step == "fork":
            for block in table:
                ref_counts[block] += 1
            sequences.append((list(table), length))
            continue
        place = function(table, length, block_size, ref_counts, allocate, lambda a, b: log.append(("copy", a, b)))
        log.append(("token", index, place))
        sequences[index] = (table, length + 1)
    return log, [table for table, _ in sequences], dict(sorted(ref_counts.items()))


def gather_kv(pool, table, length):
    """Reference: the first `length` rows of a sequence, (length, n_kv_heads, head_dim), from
    pool (num_blocks, block_size, n_kv_heads, head_dim) through its block table."""
    return np.concatenate([pool[block] for block in table])[:length] if length else pool[:0, 0]


def _allocator_case(rng):
    ops = [(str(rng.choice(["allocate", "allocate", "share", "free", "free"])), int(rng.integers(0, 50)))
           for _ in range(int(rng.integers(5, 40)))]
    return int(rng.integers(1, 6)), ops


def _append_case(rng):
    return int(rng.choice([1, 2, 4, 16])), int(rng.integers(1, 60))


def _cow_case(rng):
    return int(rng.choice([1, 2, 4])), [(str(rng.choice(["token", "token", "token", "fork"])), int(rng.integers(0, 9)))
                                        for _ in range(int(rng.integers(1, 40)))]


def _gather_case(rng):
    block_size, blocks = int(rng.choice([1, 4, 16])), int(rng.integers(1, 12))
    pool = rng.standard_normal((blocks + 4, block_size, 2, 3))
    table = [int(b) for b in rng.permutation(blocks + 4)[:blocks]]
    return pool, table, int(rng.integers(0, blocks * block_size + 1))


register(Check("ch03.Allocator", Allocator, _allocator_case, drive=drive_allocator, rtol=0, atol=0))
register(Check("ch03.append_token", append_token, _append_case, drive=drive_append, rtol=0, atol=0))
register(Check("ch03.cow_append", cow_append, _cow_case, drive=drive_cow, rtol=0, atol=0))
register(Check("ch03.gather_kv", gather_kv, _gather_case, rtol=0, atol=0))
