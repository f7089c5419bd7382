"""The drafters of chapter 07: prompt lookup against a brute-force search, and the draft model's
drafts against its own greedy continuation, its cache rolled back to what the target kept as
if it had never drafted the rest, and its q rows proper distributions that give each drafted
token a chance."""
import numpy as np
import pytest
from _numerics import fp32_tolerance
from hypothesis import given, settings, strategies as st

from infra_lab import backend as backends
from infra_lab.kv.paged import OutOfBlocks
from infra_lab.model.generate import generate
from infra_lab.model.transformer import load
from infra_lab.serving.drafters import Draft, DraftJob, ModelDrafter, PromptLookupDrafter
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.traffic import stdlib_prompts

# ---- prompt lookup -----------------------------------------------------------------------------------


def lookup_brute_force(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """For n from max_ngram down to min_ngram: the latest start s < len - n where tokens[s:s+n]
    equals the last n tokens; propose the up to k tokens after it."""
    if k < 1:
        return []
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=30), k=st.integers(0, 6), min_ngram=st.integers(1, 3),
       extra=st.integers(0, 2))
def test_lookup_against_brute_force(tokens, k, min_ngram, extra):
    drafter = PromptLookupDrafter(256, max_ngram=min_ngram + extra, min_ngram=min_ngram)
    found = drafter.lookup(tokens, k)
    assert found == lookup_brute_force(tokens, k, min_ngram + extra, min_ngram)
    assert all(type(t) is int for t in found) and len(found) <= max(k, 0)
    job = DraftJob(3, tokens, k)
    assert drafter.propose([job, job]) == [Draft(tuple(found)), Draft(tuple(found))]


def test_lookup_hand_cases():
    drafter = PromptLookupDrafter(256, max_ngram=3, min_ngram=1)
    #          0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 2, 3]
    assert drafter.lookup(tokens, 2) == [5, 2]  # "2 3" last seen at 5: the latest, not the first at 1
    assert drafter.lookup([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # the 3-gram "1 2 3" at 0
    assert drafter.lookup([1, 2, 3, 4, 1, 2, 3], 10) == [4, 1, 2, 3]  # fewer when the sequence ends
    assert drafter.lookup([7, 8, 9], 3) == []  # nothing repeats
    assert drafter.lookup([5], 3) == [] and drafter.lookup([], 3) == []
    assert drafter.lookup([5, 5], 3) == [5]
    assert drafter.lookup(tokens, 0) == []
    assert PromptLookupDrafter(256, max_ngram=3, min_ngram=3).lookup([1, 2, 9, 1, 2], 2) == []  # 2-grams too short


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 0), (2, 3), (0, 0), (1, -1)])
def test_bad_ngram_sizes_are_refused(max_ngram, min_ngram):
    with pytest.raises(ValueError, match=f"1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}"):
        PromptLookupDrafter(256, max_ngram=max_ngram, min_ngram=min_ngram)


# ---- the draft model ---------------------------------------------------------------------------------

BACKENDS = ["torch", "numba"]
PROMPTS = stdlib_prompts([20, 33, 9], seed=4)


@pytest.fixture(scope="module")
def draft():
    return load("draft")


def full_pool(drafter: ModelDrafter) -> bool:
    return drafter.pool.num_free == drafter.pool.allocator.num_blocks and not drafter.pool.tables


@pytest.mark.parametrize("name", BACKENDS)
def test_a_greedy_draft_is_the_draft_models_greedy_continuation(draft, name):
    """Three sequences drafted together, each as long as its job allows."""
    backend = backends.resolve(name)
    drafter = ModelDrafter(draft, backend=backend)
    ks = [5, 1, 3]
    drafts = drafter.propose([DraftJob(i, prompt, k) for i, (prompt, k) in enumerate(zip(PROMPTS, ks))])
    for prompt, k, got in zip(PROMPTS, ks, drafts):
        assert list(got.tokens) == generate(draft, prompt, k, temperature=0, backend=backend).new_tokens
        assert got.q.shape == (k, 256) and (got.q[np.arange(k), list(got.tokens)] == 1).all()  # point masses
    drafter.retain([1])
    assert sorted(drafter.seqs) == [1]
    drafter.retain([])
    assert not drafter.seqs and full_pool(drafter)


def test_a_job_of_no_tokens_drafts_nothing(draft):
    drafter = ModelDrafter(draft, backend=backends.resolve("torch"))
    assert drafter.propose([DraftJob(0, PROMPTS[0], 0)]) == [Draft(())]


def snapshot(drafter: ModelDrafter, key: int):
    """The tokens the drafter's cache holds for `key`, and their keys and values in layer 0 and the last."""
    pool, seq = drafter.pool, drafter.seqs[key]
    length = pool.lengths[seq]
    layers = (0, drafter.model.config.n_layers - 1)
    return list(pool.tokens[seq]), [np.asarray(pool.gather(seq, layer, length)) for layer in layers]


@pytest.mark.numerics
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_after_a_rejection_the_cache_is_as_if_the_rest_was_never_drafted(draft, data):
    """Round 1 drafts k1 tokens; the target keeps `kept` of them and adds its own token (the next
    job's tokens diverge there), or the sequence is cut further back (a preempted request's
    recompute). Round 2's draft, and the cache after it, equal a fresh drafter's."""
    backend = backends.resolve("torch")
    prompt = PROMPTS[data.draw(st.integers(0, 2))]
    k1, k2 = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    drafter = ModelDrafter(draft, backend=backend, num_blocks=16, block_size=4)
    first = drafter.propose([DraftJob(7, prompt, k1)])[0]
    assert drafter.pool.tokens[drafter.seqs[7]] == prompt + list(first.tokens[:-1])  # its last draft is never fed
    kept = data.draw(st.integers(-len(prompt) + 1, k1))  # < 0: cut back into the prompt
    own = data.draw(st.integers(0, 255))
    tokens = (prompt + list(first.tokens[:kept]) if kept >= 0 else prompt[:kept]) + [own]
    second = drafter.propose([DraftJob(7, tokens, k2)])[0]
    fresh = ModelDrafter(draft, backend=backend, num_blocks=16, block_size=4)
    expected = fresh.propose([DraftJob(7, tokens, k2)])[0]
    assert second.tokens == expected.tokens and np.allclose(second.q, expected.q)
    (ours, our_kv), (theirs, their_kv) = snapshot(drafter, 7), snapshot(fresh, 7)
    assert ours == theirs == tokens + list(second.tokens[:-1])
    c = draft.config
    # The two caches hold keys and values computed in other chunks: float32 sums taken in other
    # orders. Layer 0's are a norm and a projection of d terms each (2 d); the last layer's add the
    # blocks before it: projections (3 d), attention over the tokens, the MLP (d_ff): worst case
    # n eps32 times the largest value (measured: 2e-6 on values up to 9, about 0.003 of it).
    through_block = 4 * c.d_model + len(tokens) + c.d_ff
    for terms, mine, reference in zip((2 * c.d_model, 2 * c.d_model + (c.n_layers - 1) * through_block), our_kv,
                                      their_kv):
        for got, want in zip(mine, reference):  # keys, values
            assert np.abs(got - want).max() <= fp32_tolerance(terms, np.abs(want).max())
    assert drafter.pool.num_free == fresh.pool.num_free  # rejected blocks went back
    drafter.retain(())
    assert full_pool(drafter)


def test_a_new_round_feeds_only_what_the_cache_lacks(draft):
    """All k drafts accepted plus the target's token: the cache lacks the last draft and that token."""
    drafter = ModelDrafter(draft, backend=backends.resolve("torch"))
    prompt = PROMPTS[1]
    first = drafter.propose([DraftJob(0, prompt, 3)])[0]
    tokens = prompt + list(first.tokens) + [65]
    assert drafter._catch_up(DraftJob(0, tokens, 2)) == [first.tokens[-1], 65]
    assert drafter._catch_up(DraftJob(0, tokens[:5], 2)) == tokens[4:5]  # cut back: the last token is fed again
    assert drafter.pool.tokens[drafter.seqs[0]] == tokens[:4]


@pytest.mark.numerics
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=0.7, top_k=10, seed=3),
                                    SamplingParams(temperature=1.2, top_p=0.8, seed=3)])
def test_sampled_drafts_come_with_their_distributions(draft, params):
    backend = backends.resolve("torch")
    drafter = ModelDrafter(draft, backend=backend)
    jobs = [DraftJob(i, prompt, 4, params, np.random.default_rng(i)) for i, prompt in enumerate(PROMPTS)]
    drafts = drafter.propose(jobs)
    for got in drafts:
        assert got.q.shape == (4, 256) and got.q.dtype == np.float64
        assert np.allclose(got.q.sum(axis=1), 1) and (got.q >= 0).all()
        assert (got.q[np.arange(4), list(got.tokens)] > 0).all()  # each token was drawn from its row
        if params.top_k:
            assert ((got.q > 0).sum(axis=1) <= params.top_k).all()
    again = ModelDrafter(draft, backend=backend).propose(
        [DraftJob(i, prompt, 4, params, np.random.default_rng(i)) for i, prompt in enumerate(PROMPTS)])
    assert [d.tokens for d in again] == [d.tokens for d in drafts]  # the rng decides: same seed, same draft
    first_row = ModelDrafter(draft, backend=backend).propose([DraftJob(0, PROMPTS[0], 1, params,
                                                                       np.random.default_rng(0))])[0].q[0]
    assert np.allclose(first_row, drafts[0].q[0], atol=1e-6)  # q's first row does not depend on the batch


def test_a_drafter_pool_too_small_says_so_and_stays_consistent(draft):
    """The failed forward's blocks go back; the cache may have rolled back (it is a cache), but
    what it holds is right: the next draft is a fresh drafter's."""
    backend = backends.resolve("torch")
    drafter = ModelDrafter(draft, backend=backend, num_blocks=2, block_size=4)
    job = DraftJob(0, [65, 66, 67], 2)
    drafter.propose([job])
    with pytest.raises(OutOfBlocks, match="drafter's pool is full .* give it more num_blocks"):
        drafter.propose([job, DraftJob(1, PROMPTS[0], 2)])  # 20 tokens: 5 blocks
    assert drafter.pool.num_free == 2 - sum(len(t) for t in drafter.pool.tables.values())
    assert drafter.propose([job])[0].tokens == ModelDrafter(draft, backend=backend).propose([job])[0].tokens
    drafter.retain(())
    assert full_pool(drafter)
