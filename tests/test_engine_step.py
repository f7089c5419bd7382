"""The model's one step entry, driven by per-step metadata: the same greedy tokens from every KV
layout and backend, mixed batches that equal their sequences run alone, and named errors that
leave the pool as it was."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend, model
from infra_lab.kv import metadata
from infra_lab.kv.paged import PagedKVCache
from infra_lab.kv.radix import RadixCache
from infra_lab.model.generate import generate_many
from infra_lab.serving import radix_serving

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target():
    return model.load("target")


@pytest.fixture(scope="module")
def prompts():
    return [b"import os\ndef main(", b"class Stack:\n    def push(self, item):\n", b"for i in range(",
            b"    return sorted(items, key=lambda x: x["]


@pytest.fixture(scope="module")
def contiguous_numba(target, prompts):
    return generate_many(target, prompts, NEW_TOKENS, backend=backend.resolve("numba"))


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["numba", "torch", "numpy"])
@pytest.mark.parametrize("block_size", [1, 16, None])  # None: contiguous, a block of the whole context
def test_greedy_tokens_are_the_same_from_every_layout_and_backend(target, prompts, contiguous_numba, name,
                                                                  block_size):
    if name not in backend.available():
        pytest.skip(f"{name} is not installed")
    chosen = backend.resolve(name, "cpu")
    pool = None if block_size is None else target.new_paged_cache(400 // block_size + 8, block_size, backend=chosen)
    assert generate_many(target, prompts, NEW_TOKENS, paged=pool, backend=chosen) == contiguous_numba


@pytest.mark.numerics
def test_the_radix_token_pool_gives_the_same_tokens(target, prompts, contiguous_numba):
    queue = prompts + prompts[:2]  # the repeats prefill after a radix hit
    served = radix_serving.serve_model(target, queue, NEW_TOKENS, n_slots=400, cache=RadixCache())
    assert served.cached_tokens > 0
    assert served.outputs == contiguous_numba + contiguous_numba[:2]


def run_alone(target, tokens: list[int], chunk: int, chosen) -> np.ndarray:
    """Logits of every position of `tokens`, prefilled `chunk` tokens at a time into a cache of its own."""
    cache = target.new_cache(backend=chosen)
    return np.concatenate([target.forward(tokens[i:i + chunk], cache, chosen) for i in range(0, len(tokens), chunk)])


@pytest.mark.numerics
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 4, 16]),
       name=st.sampled_from(["numba", "torch"]), data=st.data())
@pytest.mark.slow
def test_a_mixed_batch_equals_its_sequences_run_alone(target, seed, block_size, name, data):
    """Each step mixes sequences at different stages: a prefill chunk from nothing, a chunk after
    a cached prefix (some of it shared through match_prefix), single-token decodes, and several
    drafted tokens at once. Every row's logits must equal those of its sequence run alone."""
    rng = np.random.default_rng(seed)
    chosen = backend.resolve(name, "cpu")
    pool = target.new_paged_cache(400, block_size, prefix_sharing=True, backend=chosen)
    shared = rng.integers(0, 256, 40).tolist()
    n_seqs = data.draw(st.integers(2, 5))
    texts = [(shared if rng.random() < 0.5 else []) + rng.integers(0, 256, int(rng.integers(5, 60))).tolist()
             for _ in range(n_seqs)]
    warm = pool.new_sequence()  # an earlier request leaves the shared prefix cached
    target.forward(shared + [7], pool.view(warm), chosen)
    pool.free(warm)
    seqs = [pool.new_sequence() for _ in texts]
    done = [pool.match_prefix(seq, text) for seq, text in zip(seqs, texts)]
    hits = list(done)  # positions whose KV came from the prefix cache: no logits computed for them
    assert all(hit >= 32 for hit, text in zip(hits, texts) if text[:40] == shared)
    logits = [np.zeros((len(text), 256), np.float32) for text in texts]
    while any(d < len(t) for d, t in zip(done, texts)):
        active = [b for b in range(n_seqs) if done[b] < len(texts[b])]
        counts = [min(len(texts[b]) - done[b], int(rng.choice([1, 1, 3, 17]))) for b in active]
        pool.reserve_all([seqs[b] for b in active], counts)
        meta = pool.step_metadata([seqs[b] for b in active], counts)
        tokens = np.concatenate([texts[b][done[b]:done[b] + n] for b, n in zip(active, counts)])
        out = target.step(tokens, meta, pool, chosen)
        for row, (b, n) in enumerate(zip(active, counts)):
            logits[b][done[b]:done[b] + n] = out[meta.query_starts[row]:meta.query_starts[row + 1]]
            pool.commit(seqs[b], texts[b][done[b]:done[b] + n])
            done[b] += n
    for b, text in enumerate(texts):
        alone = run_alone(target, text, 13, chosen)[hits[b]:]
        mixed = logits[b][hits[b]:]
        assert np.abs(mixed - alone).max() < 1e-3
        assert (mixed.argmax(-1) == alone.argmax(-1)).all()


@pytest.mark.numerics
def test_truncate_rolls_back_drafted_tokens_and_the_model_continues_as_if_they_never_were(target):
    chosen = backend.resolve("numba")
    pool = target.new_paged_cache(40, 4)
    seq = pool.new_sequence()
    text = list(b"def rolled_back(x):\n    return")
    view = pool.view(seq)
    target.forward(text, view, chosen)
    target.forward(list(b" wrong draft"), view, chosen)  # 12 drafted tokens, all rejected
    free_before = pool.num_free
    pool.truncate(seq, len(text))
    assert pool.num_free > free_before  # whole blocks went back
    again = target.forward([32], view, chosen)[-1]
    assert np.allclose(again, run_alone(target, text + [32], 64, chosen)[-1], atol=1e-4)


# ---- bad input: a named error, and the pool as it was -------------------------------------------

def pool_state(pool: PagedKVCache) -> tuple:
    return ({s: list(t) for s, t in pool.tables.items()}, dict(pool.lengths), list(pool.allocator.ref_counts),
            pool.kv.copy())


@pytest.fixture
def pool_with_two(target):
    pool = target.new_paged_cache(10, 4, backend=backend.resolve("numba"))
    a, b = pool.new_sequence(), pool.new_sequence()
    for seq, text in ((a, b"hello there"), (b, b"x = 1")):
        target.forward(list(text), pool.view(seq), backend.resolve("numba"))
    pool.reserve_all([a, b], [1, 1])
    return pool, [a, b]


def test_bad_metadata_is_named_and_changes_nothing(target, pool_with_two):
    pool, seqs = pool_with_two
    good = pool.step_metadata(seqs, [1, 1])
    before = pool_state(pool)
    bad = {
        "query_starts must rise from 0": metadata.StepMetadata(
            np.array([0, 2, 2]), good.context_lens, good.block_tables, good.slot_mapping, 4),
        "slot_mapping holds 400, outside the pool's 40 slots": metadata.StepMetadata(
            good.query_starts, good.context_lens, good.block_tables, np.array([good.slot_mapping[0], 400]), 4),
        r"slot_mapping\[0\] = 17, but sequence 0's block table puts its position 11 in slot 11": metadata.StepMetadata(
            good.query_starts, good.context_lens, good.block_tables, good.slot_mapping[::-1].copy(), 4),
        "sequence 0: context_lens 99 must be": metadata.StepMetadata(
            good.query_starts, np.array([99, good.context_lens[1]]), good.block_tables, good.slot_mapping, 4),
        "the metadata's block_size is 8": metadata.StepMetadata(
            good.query_starts, good.context_lens, good.block_tables, good.slot_mapping, 8),
    }
    for message, meta in bad.items():
        with pytest.raises(ValueError, match=message):
            target.step([1, 2], meta, pool, backend.resolve("numba"))
        after = pool_state(pool)
        assert after[:3] == before[:3] and np.array_equal(after[3], before[3])
    with pytest.raises(ValueError, match=r"need one token per row of the metadata \(2\)"):
        target.step([1, 2, 3], good, pool, backend.resolve("numba"))


def test_a_block_table_entry_that_is_not_allocated_is_named(target, pool_with_two):
    pool, seqs = pool_with_two
    good = pool.step_metadata(seqs, [1, 1])
    free_block = next(b for b in range(10) if pool.allocator.ref_counts[b] == 0)
    tables = good.block_tables.copy()
    tables[1, 0] = free_block
    context, where = good.context_lens, good.positions
    slots = tables[[0, 1], where // 4] * 4 + where % 4
    meta = metadata.StepMetadata(good.query_starts, context, tables, slots, 4)
    before = pool_state(pool)
    with pytest.raises(ValueError, match=f"block {free_block} is in a block table but not allocated"):
        target.step([1, 2], meta, pool, backend.resolve("numba"))
    assert pool_state(pool)[:3] == before[:3]


def test_metadata_for_sequences_without_room_and_truncate_past_the_start_are_named(pool_with_two):
    pool, (a, b) = pool_with_two
    with pytest.raises(ValueError, match=f"sequence {a} holds 11 tokens in 3 blocks of 4: reserve room for 5"):
        pool.step_metadata([a], [5])
    before = pool_state(pool)
    with pytest.raises(ValueError, match=rf"cannot truncate sequence {a} to -1 tokens; allowed 0..11"):
        pool.truncate(a, -1)
    with pytest.raises(ValueError, match=rf"cannot truncate sequence {a} to 12 tokens; allowed 0..11"):
        pool.truncate(a, 12)
    assert pool_state(pool)[:3] == before[:3]


def test_reserving_for_a_batch_is_all_or_nothing(target):
    pool = target.new_paged_cache(3, 4)
    a, b = pool.new_sequence(), pool.new_sequence()
    with pytest.raises(Exception, match="need 4 blocks for 2 sequences but only 3 of 3 are free"):
        pool.reserve_all([a, b], [8, 5])
    assert pool.tables[a] == [] and pool.tables[b] == [] and pool.num_free == 3


def test_decode_batch_needs_views_of_one_pool(target):
    caches = [target.new_cache(), target.new_cache()]
    with pytest.raises(ValueError, match="decode_batch needs views of one pool"):
        target.decode_batch([1, 2], caches)


def test_a_failed_forward_hands_back_the_blocks_it_reserved(target, monkeypatch):
    pool = target.new_paged_cache(10, 4)
    seq = pool.new_sequence()
    target.forward(list(b"abcde"), pool.view(seq))
    before = pool_state(pool)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(target, "step", broken)
    with pytest.raises(RuntimeError, match="kernel failed"):
        target.forward(list(b"fghijklmn"), pool.view(seq))
    assert pool_state(pool)[:3] == before[:3]


def test_a_pool_on_the_wrong_backend_is_named(target):
    numpy_cache = target.new_cache(backend=backend.resolve("numba"))
    with pytest.raises(ValueError, match="the KV pool holds numpy arrays, but the torch backend needs torch tensors"):
        target.forward([1, 2], numpy_cache, backend.resolve("torch", "cpu"))
    assert numpy_cache.length == 0 and numpy_cache.cache.num_free == 1
    torch_cache = target.new_cache(backend=backend.resolve("torch", "cpu"))
    with pytest.raises(ValueError, match="holds torch tensors on cpu, but the numba backend needs numpy arrays"):
        target.forward([1, 2], torch_cache, backend.resolve("numba"))


def test_attach_prefix_names_what_it_cannot_take(target):
    pool = target.new_paged_cache(6, 1)
    owner = pool.new_sequence()
    target.forward([5, 6, 7], pool.view(owner))
    held = pool.tables[owner]
    seq = pool.new_sequence()
    with pytest.raises(ValueError, match="3 tokens fill 3 blocks of 1; got 2 blocks"):
        pool.attach_prefix(seq, held[:2], [5, 6, 7])
    with pytest.raises(ValueError, match="block 4 is not allocated"):
        pool.attach_prefix(seq, [held[0], 4], [5, 6])
    pool.attach_prefix(seq, held, [5, 6, 7])
    assert pool.lengths[seq] == 3 and all(pool.allocator.ref_counts[b] == 2 for b in held)
    sharing = target.new_paged_cache(4, 2, prefix_sharing=True)
    with pytest.raises(ValueError, match="use match_prefix"):
        sharing.attach_prefix(sharing.new_sequence(), [], [])
