"""Chapter 03's exercise references run beside the package's paged cache they teach.

Allocator beside BlockAllocator: they share free counts, reference counts, the errors for a free
block, and OutOfBlocks when the pool is empty. They differ in one thing only, on purpose: which
free block comes next. The exercise promises the smallest free id (a heap), so a student's choice
of block can be graded; BlockAllocator hands out blocks first in, first out (never-used ones
first), so the sides are paired by allocation, not by block id. BlockAllocator also has what the
exercise leaves out: allocate(n) returns a list of n blocks (all or nothing), share is called
incref, and free(block, keep_as) can keep a block cached for prefix sharing (not driven here).

append_token and cow_append beside PagedKVCache.reserve (and fork), with the reference's
allocate() drawing from a BlockAllocator of the same size, so both sides must pick the same
blocks; gather_kv beside PagedKVCache.gather.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from infra_lab.grading import check, ch03
from infra_lab.kv.paged import BlockAllocator, OutOfBlocks, PagedKVCache

# ---- Allocator beside BlockAllocator ----------------------------------------------------------

ALLOCATOR_OPS = st.lists(st.tuples(
    st.sampled_from(["allocate", "allocate", "allocate_many", "share", "free", "free",
                     "share_a_free_block", "free_a_free_block"]),
    st.integers(0, 20)), max_size=60)


def outcome(call):
    """("ok", value) or ("error", the error's type)."""
    try:
        return "ok", call()
    except (RuntimeError, ValueError) as error:
        return "error", type(error)


class SideBySide:
    """The reference and the package under the same operations. `held` has one (reference
    block, package block) pair per reference either side holds, so the sides are compared by
    allocation, never by block id."""

    def __init__(self, num_blocks):
        self.reference, self.package = ch03.Allocator(num_blocks), BlockAllocator(num_blocks)
        self.held: list[tuple[int, int]] = []

    def allocate(self, _):
        got = outcome(self.reference.allocate), outcome(lambda: self.package.allocate()[0])
        assert got[0][0] == got[1][0] and (got[0][0] == "ok" or got[0][1] is got[1][1] is OutOfBlocks), got
        if got[0][0] == "ok":
            self.held.append((got[0][1], got[1][1]))

    def allocate_many(self, n):
        """The package's all-or-nothing allocate(n) against n of the reference's allocate()."""
        before = self.package.num_free, list(self.package.ref_counts)
        if n > self.reference.num_free:
            with pytest.raises(OutOfBlocks):
                self.package.allocate(n)
            assert (self.package.num_free, self.package.ref_counts) == before  # nothing taken
            return
        self.held.extend(zip([self.reference.allocate() for _ in range(n)], self.package.allocate(n)))

    def share(self, pick):
        if self.held:
            pair = self.held[pick % len(self.held)]
            self.reference.share(pair[0])
            self.package.incref(pair[1])
            self.held.append(pair)

    def free(self, pick):
        if self.held:
            pair = self.held.pop(pick % len(self.held))
            self.reference.free(pair[0])
            self.package.free(pair[1])

    def share_a_free_block(self, pick):
        self._on_a_free_block(pick, lambda block: self.reference.share(block), self.package.incref)

    def free_a_free_block(self, pick):
        self._on_a_free_block(pick, self.reference.free, self.package.free)

    def _on_a_free_block(self, pick, reference_call, package_call):
        """Both sides raise ValueError for a block that is free, and change nothing."""
        free_ids = (sorted(b for b, count in enumerate(self.reference.ref_counts) if count == 0),
                    sorted(b for b, count in enumerate(self.package.ref_counts) if count == 0))
        if not free_ids[0]:
            return
        before = self.state()
        for ids, call in zip(free_ids, (reference_call, package_call)):
            block = ids[pick % len(ids)]
            with pytest.raises(ValueError, match=rf"block {block} is"):  # the message names the block
                call(block)
        assert self.state() == before

    def state(self):
        return (self.reference.num_free, self.package.num_free, list(self.reference.ref_counts),
                list(self.package.ref_counts))

    def assert_agree(self):
        assert self.reference.num_free == self.package.num_free
        assert sorted(self.reference.ref_counts) == sorted(self.package.ref_counts)
        for pair in set(self.held):
            holders = self.held.count(pair)
            assert self.reference.ref_counts[pair[0]] == self.package.ref_counts[pair[1]] == holders, pair


@given(num_blocks=st.integers(1, 6), ops=ALLOCATOR_OPS)
def test_the_allocator_reference_counts_like_the_package(num_blocks, ops):
    sides = SideBySide(num_blocks)
    for op, argument in ops:
        getattr(sides, op)(argument)
        sides.assert_agree()


def test_the_one_difference_is_which_free_block_comes_next():
    reference, package = ch03.Allocator(4), BlockAllocator(4)
    for _ in range(3):
        reference.allocate(), package.allocate()
    reference.free(0), package.free(0)
    assert reference.allocate() == 0  # the smallest free id, as the exercise promises
    assert package.allocate() == [3]  # first in, first out: the never-used block 3 before 0


def test_out_of_blocks_is_the_packages_error_and_a_runtime_error():
    reference = ch03.Allocator(1)
    reference.allocate()
    with pytest.raises(OutOfBlocks, match="all 1 blocks are in use"):
        reference.allocate()
    assert issubclass(OutOfBlocks, RuntimeError)  # what the exercise tells students to raise


def test_a_student_raising_plain_runtime_error_still_passes(capsys):
    class RaisesRuntimeError(ch03.Allocator):
        def allocate(self):
            if not self.free_ids:
                raise RuntimeError("no free block")
            return super().allocate()

    check("ch03.Allocator", RaisesRuntimeError)
    assert capsys.readouterr().out == "PASS ch03.Allocator 24/24\n"


@pytest.mark.parametrize("block", [-1, 3])
def test_a_block_outside_the_pool_is_named(block):
    with pytest.raises(ValueError, match=f"block {block} is outside the pool: blocks are 0..2"):
        ch03.Allocator(3).free(block)


# ---- append_token and cow_append beside PagedKVCache.reserve --------------------------------

def one_layer_cache(num_blocks, block_size, n_kv_heads=1, head_dim=1, n_layers=1):
    return PagedKVCache(n_layers, n_kv_heads, head_dim, num_blocks, block_size)


def append_to_package(cache, seq, value):
    """One token whose K row is all `value`, the way the serving loop appends."""
    cache.reserve(seq, 1)
    row = np.full((1,) + cache.k.shape[3:], value, cache.k.dtype)
    cache.write(seq, 0, row, row)
    cache.commit(seq, [value])


@given(block_size=st.integers(1, 6), chunks=st.lists(st.integers(0, 7), max_size=12))
def test_append_token_places_tokens_as_reserve_and_write_do(block_size, chunks):
    n_tokens = sum(chunks)
    num_blocks = n_tokens // block_size + 1
    cache, allocator = one_layer_cache(num_blocks, block_size), BlockAllocator(num_blocks)
    seq, table, length = cache.new_sequence(), [], 0
    for chunk in chunks:
        cache.reserve(seq, chunk)  # the package makes room for a chunk at once
        for _ in range(chunk):
            block, slot = ch03.append_token(table, length, block_size, lambda: allocator.allocate()[0])
            row = np.full((1, 1, 1), length, np.float32)
            cache.write(seq, 0, row, row)
            cache.commit(seq, [length])
            assert cache.k[0, block, slot, 0, 0] == length  # the package wrote it where the reference says
            length += 1
        assert table == cache.tables[seq]
        assert allocator.num_free == cache.allocator.num_free


COW_SCRIPTS = st.lists(st.tuples(st.sampled_from(["token", "token", "token", "fork"]), st.integers(0, 8)),
                       max_size=40)


class ReferenceSequences:
    """Block tables on plain lists, grown with ch03.cow_append; allocate() draws from a
    BlockAllocator, whose ref_counts list is the one cow_append reads and decrements."""

    def __init__(self, num_blocks, block_size):
        self.allocator, self.block_size = BlockAllocator(num_blocks), block_size
        self.pool = np.zeros((num_blocks, block_size))
        self.tables, self.lengths = [[]], [0]

    def fork(self, index):
        for block in self.tables[index]:
            self.allocator.incref(block)
        self.tables.append(list(self.tables[index]))
        self.lengths.append(self.lengths[index])

    def append(self, index, value):
        place = ch03.cow_append(self.tables[index], self.lengths[index], self.block_size,
                                self.allocator.ref_counts, lambda: self.allocator.allocate()[0], self._copy)
        self.pool[place] = value
        self.lengths[index] += 1

    def _copy(self, old, new):
        self.pool[new] = self.pool[old]

    def rows(self, index):
        return self.pool[self.tables[index]].reshape(-1)[:self.lengths[index]]


@given(block_size=st.integers(1, 4), script=COW_SCRIPTS)
def test_cow_append_copies_and_counts_as_fork_and_reserve_do(block_size, script):
    num_blocks = 2 * len(script) + 1  # every token could take a fresh block, and a copy
    cache, reference = one_layer_cache(num_blocks, block_size), ReferenceSequences(num_blocks, block_size)
    seqs = [cache.new_sequence()]
    for value, (step, pick) in enumerate(script, start=1):
        index = pick % len(seqs)
        if step == "fork":
            seqs.append(cache.fork(seqs[index]))
            reference.fork(index)
        else:
            append_to_package(cache, seqs[index], value)
            reference.append(index, value)
        assert reference.tables == [cache.tables[seq] for seq in seqs]
        assert reference.allocator.ref_counts == cache.allocator.ref_counts
        assert reference.allocator.num_free == cache.allocator.num_free
        for index, seq in enumerate(seqs):
            assert np.array_equal(reference.rows(index), cache.gather(seq, 0, cache.lengths[seq])[0].reshape(-1))


# ---- gather_kv beside PagedKVCache.gather -------------------------------------------------------

@given(block_size=st.integers(1, 5), n_kv_heads=st.integers(1, 3), head_dim=st.integers(1, 4),
       appends=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9)), max_size=10), seed=st.integers(0, 2**16))
def test_gather_kv_reads_what_the_package_gathers(block_size, n_kv_heads, head_dim, appends, seed):
    """Three sequences grown in turns, so their blocks interleave in the pool."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(n for _, n in appends) + 3
    cache = one_layer_cache(num_blocks, block_size, n_kv_heads, head_dim, n_layers=2)
    seqs = [cache.new_sequence() for _ in range(3)]
    for index, n_new in appends:
        cache.reserve(seqs[index], n_new)
        for layer in range(2):
            k, v = rng.standard_normal((2, n_new, n_kv_heads, head_dim)).astype(np.float32)
            cache.write(seqs[index], layer, k, v)
        cache.commit(seqs[index], range(n_new))
    for seq in seqs:
        for layer in range(2):
            for length in range(cache.lengths[seq] + 1):
                k, v = cache.gather(seq, layer, length)
                assert np.array_equal(ch03.gather_kv(cache.k[layer], cache.tables[seq], length), k)
                assert np.array_equal(ch03.gather_kv(cache.v[layer], cache.tables[seq], length), v)
