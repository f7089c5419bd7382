"""Speculative decoding for one sequence (chapter 07): the theory's formulas against brute force
and Leviathan et al.'s numbers; the acceptance rules against brute force (greedy) and an exact
enumeration of the rule's outcomes (sampling: the first emitted token is distributed as p, for
any q); the tally on hand-made verdicts; `speculative_generate` gives the target's greedy tokens
for every γ, drafter and backend, and its measured tokens per forward match the theory; bad
input is refused by name."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend as backends
from infra_lab.model.generate import generate
from infra_lab.model.transformer import load
from infra_lab.serving.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from infra_lab.serving.exactness import fit
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.speculative import (Tally, Verdict, accept, accept_all, accept_greedy, accept_sampling,
                                           best_gamma, check_gamma, expected_tokens, speculative_generate,
                                           speedup)
from infra_lab.serving.traffic import stdlib_prompts
from conftest import tiny_model

BAD_GAMMAS = [0, -1, 1.5, True, "2", None]


@pytest.fixture(scope="module")
def target():
    return load("target")


@pytest.fixture(scope="module")
def draft():
    return load("draft")


# ---- theory ----------------------------------------------------------------------------------------

alphas = st.floats(0, 1)
gammas = st.integers(1, 12)


@settings(max_examples=50, deadline=None)
@given(alpha=alphas, gamma=gammas)
def test_expected_tokens_is_the_truncated_geometric_sum(alpha, gamma):
    """Token i (0-based) comes out of a forward iff the first i drafts were accepted: Σ α^i."""
    assert expected_tokens(alpha, gamma) == pytest.approx(sum(alpha ** i for i in range(gamma + 1)), rel=1e-9)


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_expected_tokens_at_the_ends(gamma):
    assert expected_tokens(1.0, gamma) == gamma + 1  # every draft kept, plus the bonus
    assert expected_tokens(0.0, gamma) == 1  # none kept: the target's own token only
    assert expected_tokens(1 - 1e-12, gamma) == pytest.approx(gamma + 1)  # continuous at α = 1


def test_leviathans_example():
    """Leviathan et al., section 3: α = 0.8, γ = 5, c = 0.05."""
    tokens = (1 - 0.8 ** 6) / 0.2
    assert tokens == pytest.approx(3.68928)
    assert expected_tokens(0.8, 5) == pytest.approx(3.68928)
    assert speedup(0.8, 5, 0.05) == pytest.approx(3.68928 / 1.25) == pytest.approx(2.951424)


@settings(max_examples=50, deadline=None)
@given(alpha=alphas, gamma=gammas, c=st.floats(0, 2))
def test_speedup_is_tokens_over_the_cost_of_a_round(alpha, gamma, c):
    assert speedup(alpha, gamma, c) == pytest.approx(sum(alpha ** i for i in range(gamma + 1)) / (gamma * c + 1))


@settings(max_examples=50, deadline=None)
@given(alpha=alphas, c=st.floats(0, 1), max_gamma=st.integers(1, 16))
def test_best_gamma_is_the_brute_force_argmax(alpha, c, max_gamma):
    values = [sum(alpha ** i for i in range(g + 1)) / (g * c + 1) for g in range(1, max_gamma + 1)]
    best = best_gamma(alpha, c, max_gamma)
    assert 1 <= best <= max_gamma
    assert values[best - 1] == pytest.approx(max(values), rel=1e-9)


def test_best_gamma_known_cases():
    assert best_gamma(0.0, 0.1) == 1  # nothing is ever accepted: draft as little as allowed
    assert best_gamma(1.0, 0.0, 16) == 16  # free drafts, all accepted: the most allowed
    assert best_gamma(0.8, 0.05) == 8  # Leviathan's α and c: 3.092 at γ = 8, against 3.078 at 9 and 3.082 at 7
    assert best_gamma(0.8, 0.05, 5) == 5  # capped: still rising at 5


@pytest.mark.parametrize("alpha", [-0.1, 1.1, float("nan")])
def test_a_bad_alpha_is_refused(alpha):
    with pytest.raises(ValueError, match="alpha .* must be in \\[0, 1\\]"):
        expected_tokens(alpha, 3)
    with pytest.raises(ValueError, match="alpha"):
        speedup(alpha, 3, 0.1)


@pytest.mark.parametrize("gamma", BAD_GAMMAS)
def test_a_bad_gamma_is_refused(gamma):
    with pytest.raises(ValueError, match="gamma .* must be an integer >= 1"):
        check_gamma(gamma)
    with pytest.raises(ValueError, match="gamma"):
        expected_tokens(0.5, gamma)
    with pytest.raises(ValueError, match="gamma"):
        best_gamma(0.5, 0.1, gamma)


def test_check_gamma_takes_numpy_integers():
    assert check_gamma(np.int64(3)) == 3 and type(check_gamma(np.int64(3))) is int


def test_a_negative_cost_is_refused():
    with pytest.raises(ValueError, match="c .* must be >= 0; got -0.1"):
        speedup(0.5, 3, -0.1)


# ---- greedy acceptance ------------------------------------------------------------------------------


def test_accept_greedy_hand_cases():
    target = np.array([5, 6, 7, 8])  # the target's argmax after each prefix
    assert accept_greedy(target, (5, 6, 9)) == Verdict(2, (5, 6, 7))  # the third differs: 7 replaces it
    assert accept_greedy(target, (5, 6, 7)) == Verdict(3, (5, 6, 7, 8))  # all kept, plus the bonus
    assert accept_greedy(target, (4, 6, 7)) == Verdict(0, (5,))  # the first differs: nothing kept
    assert accept_greedy(target[:1], ()) == Verdict(0, (5,))  # no draft: a plain decode


@settings(max_examples=100, deadline=None)
@given(data=st.data(), k=st.integers(0, 8))
def test_accept_greedy_against_a_brute_force_loop(data, k):
    target = data.draw(st.lists(st.integers(0, 3), min_size=k + 1, max_size=k + 1))
    drafted = tuple(data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k)))
    kept = []
    for i in range(k):
        if drafted[i] != target[i]:
            break
        kept.append(drafted[i])
    verdict = accept_greedy(np.array(target), drafted)
    assert verdict == Verdict(len(kept), tuple(kept) + (target[len(kept)],))
    assert all(type(t) is int for t in verdict.tokens)


# ---- sampling acceptance: exact enumeration of the rule ------------------------------------------------


class ScriptedRng:
    """Stands in for np.random.Generator: random() returns `u`; choice(n, p=...) records the
    distribution it was asked to draw from and returns `pick`."""

    def __init__(self, u: float, pick: int = 0):
        self.u, self.pick, self.asked = u, pick, []

    def random(self):
        return self.u

    def choice(self, n, p=None):
        self.asked.append(np.asarray(p, np.float64))
        return self.pick


def first_token_law(rule, p: np.ndarray, q: np.ndarray | None, drafted_law: np.ndarray) -> np.ndarray:
    """The exact distribution (vocab,) of the first token `rule` emits for one drafted token x
    drawn from `drafted_law`, with the uniform draw u abstracted away: the rule keeps x for u
    below a threshold that we locate by probing it, and otherwise emits a draw from the
    distribution it hands to choice(). The threshold is checked to the grid's resolution and the
    law computed from the promised min(1, p/q); the residual is the rule's own. p: (2, vocab), q:
    (1, vocab) or None."""
    vocab = p.shape[1]
    law = np.zeros(vocab)
    for x in np.flatnonzero(drafted_law):
        kept = lambda u: rule(p, (int(x),), q, ScriptedRng(u)).accepted == 1  # noqa: E731
        grid = np.linspace(0, 1, 1001)[:-1]  # u in [0, 1)
        outcomes = np.array([kept(u) for u in grid])
        cut = int(np.argmin(outcomes)) if not outcomes.all() else len(grid)
        assert outcomes[:cut].all() and not outcomes[cut:].any(), "keeping x must be monotone in u"
        q_x = q[0, x] if q is not None else 1.0
        threshold = 1.0 if p[0, x] >= q_x else p[0, x] / q_x  # the promise: keep with probability min(1, p/q)
        assert cut / len(grid) == pytest.approx(threshold, abs=1 / len(grid) + 1e-12)
        if threshold > 1 - 1e-10:  # kept but for a chance under 1e-10 (too near 1 to probe reliably)
            law[x] += drafted_law[x]
            continue
        law[x] += drafted_law[x] * threshold
        rng = ScriptedRng(u=(1 + threshold) / 2)  # above the threshold: rejected
        verdict = rule(p, (int(x),), q, rng)
        assert verdict.accepted == 0 and len(rng.asked) == 1
        residual = rng.asked[0]
        assert residual.sum() == pytest.approx(1) and (residual >= 0).all()
        law += drafted_law[x] * (1 - threshold) * residual
    return law


def simplex(vocab: int):
    """A distribution over `vocab` tokens, zeros included (not subnormal weights: u q < p rounds there)."""
    weights = st.one_of(st.just(0.0), st.floats(1e-6, 1))
    return st.lists(weights, min_size=vocab, max_size=vocab).filter(lambda w: sum(w) > 0).map(
        lambda w: np.array(w) / sum(w))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 4))
def test_the_first_token_speculative_sampling_emits_is_distributed_as_p(data, vocab):
    """Whatever q the draft comes from (zeros allowed in p and q), the emitted token's law is p."""
    p = np.stack([data.draw(simplex(vocab)), data.draw(simplex(vocab))])  # (2, vocab): the draft's row, the bonus's
    q = data.draw(simplex(vocab))[None]  # (1, vocab)
    assert first_token_law(accept_sampling, p, q, q[0]) == pytest.approx(p[0], abs=1e-8)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 4))
def test_a_point_mass_draft_q_none_is_exact_too(data, vocab):
    """q = None: the drafter proposed x deterministically; keep it with probability p(x)."""
    p = np.stack([data.draw(simplex(vocab)), data.draw(simplex(vocab))])
    x = data.draw(st.integers(0, vocab - 1))
    assert first_token_law(accept_sampling, p, None, np.eye(vocab)[x]) == pytest.approx(p[0], abs=1e-8)


def test_the_enumeration_catches_a_wrong_rule():
    """accept_all emits the draft's law q, not p: the same harness tells them apart."""
    p = np.array([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3]])
    q = np.array([[0.1, 0.3, 0.6]])
    kept = [accept_all(p, (x,), q, ScriptedRng(0.99)).accepted for x in range(3)]
    assert kept == [1, 1, 1]  # keeps even where p/q = 1/6
    with pytest.raises(AssertionError):
        first_token_law(accept_all, p, q, q[0])  # its threshold is 1 where min(1, p/q) < 1


def test_the_residual_is_where_p_exceeds_q():
    """p equals q but for a little mass moved from token 2 to token 1: a rejected draft of 2
    must become 1, the only token q under-weights."""
    eps = 1e-3
    p = np.array([[0.5, 0.3, 0.2], [0.25, 0.25, 0.5]])
    q = np.array([[0.5, 0.3 - eps, 0.2 + eps]])
    rng = ScriptedRng(u=0.999, pick=1)
    verdict = accept_sampling(p, (2,), q, rng)  # 0.999 (0.2 + eps) > 0.2: rejected
    assert verdict == Verdict(0, (1,))
    assert rng.asked[0] == pytest.approx([0, 1, 0])
    rng = ScriptedRng(u=0.99)  # 0.99 (0.2 + eps) < 0.2: kept, and the bonus comes from p's last row
    assert accept_sampling(p, (2,), q, rng).accepted == 1 and rng.asked[0] == pytest.approx(p[1])
    for x in (0, 1):  # p >= q: always kept, whatever u
        assert accept_sampling(p, (x,), q, ScriptedRng(1 - 1e-12)).accepted == 1
    assert accept_sampling(p, (0,), p[:1], ScriptedRng(1 - 1e-12)).accepted == 1  # p == q: always kept


def test_a_rejection_cuts_the_verdict_and_full_acceptance_draws_the_bonus():
    p = np.array([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    rng = ScriptedRng(u=0.5, pick=1)  # the first kept (p = q), the second rejected (p(2) = 0)
    assert accept_sampling(p, (1, 2), q, rng) == Verdict(1, (1, 1)) and rng.asked[0] == pytest.approx([0, 1, 0])
    rng = ScriptedRng(u=0.5, pick=2)
    assert accept_sampling(p, (0, 1), np.array([[1.0, 0, 0], [0, 1.0, 0]]), rng) == Verdict(0, (2,))


def test_a_draft_with_zero_probability_in_its_own_q_is_refused():
    p = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="proposed token 2 at position 0 with probability 0"):
        accept_sampling(p, (2,), np.array([[0.5, 0.5, 0.0]]), np.random.default_rng(0))


@pytest.mark.parametrize("q", [np.array([[0.6, 0.3, 0.1, 0.0]]), None])
def test_monte_carlo_first_token_matches_p(q):
    """10,000 rounds with a fixed seed: the draft drawn from q (or fixed at token 3 for a point
    mass), the first emitted token fits p; the rule that keeps everything does not."""
    p = np.array([[0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    rng, n = np.random.default_rng(7), 10_000
    drafted = rng.choice(4, n, p=q[0]) if q is not None else np.full(n, 3)
    first = np.array([accept_sampling(p, (int(x),), q, rng).tokens[0] for x in drafted])
    assert fit(first, p[0]).p_value >= 1e-3
    wrong = np.array([accept_all(p, (int(x),), q, rng).tokens[0] for x in drafted])
    assert fit(wrong, p[0]).p_value < 1e-6


def test_accept_takes_the_targets_logits_and_the_sampling_parameters():
    logits = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]))
    greedy = SamplingParams(temperature=0)
    assert accept(logits, Draft((0, 1)), greedy, np.random.default_rng(0)) == Verdict(1, (0, 2))
    seen = {}

    def rule(p, drafted, q, rng):
        seen.update(p=p, drafted=drafted, q=q)
        return Verdict(0, (0,))

    q = np.array([[0.5, 0.5, 0.0]])
    accept(logits[:2], Draft((1,), q), SamplingParams(temperature=1.0, top_k=1), np.random.default_rng(0), rule)
    assert seen["p"] == pytest.approx(np.array([[1.0, 0, 0], [0, 0, 1.0]]))  # top_k 1: the argmax alone
    assert seen["drafted"] == (1,) and seen["q"] is q
    with pytest.raises(ValueError, match=r"logits for the 2 drafted tokens plus one, \(3, vocab\); got \(2, 3\)"):
        accept(logits[:2], Draft((0, 1)), greedy, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"proposed token 3, outside the vocabulary \[0, 3\)"):
        accept(logits[:2], Draft((3,)), greedy, np.random.default_rng(0))


# ---- the tally --------------------------------------------------------------------------------------


def test_tally_on_hand_made_verdicts():
    tally = Tally(3)
    tally.add(3, Verdict(1, (4, 5)))  # first kept, second rejected: positions 0, 1 checked
    tally.add(3, Verdict(3, (4, 5, 6, 7)))  # all kept: all checked
    tally.add(2, Verdict(0, (9,)))  # a short draft (near the end), rejected at once
    tally.add(0, Verdict(0, (9,)))  # no draft: a plain decode, not a round
    assert tally.rounds == 3 and tally.emitted == 2 + 4 + 1
    assert tally.reached.tolist() == [3, 2, 1] and tally.kept.tolist() == [2, 1, 1]
    assert tally.alpha == pytest.approx(4 / 6)
    assert tally.alpha_by_position == pytest.approx([2 / 3, 1 / 2, 1])
    assert tally.tokens_per_forward == pytest.approx(7 / 3)


def test_an_empty_tally_has_no_rates():
    tally = Tally(2)
    assert np.isnan(tally.alpha) and np.isnan(tally.tokens_per_forward)
    assert np.isnan(tally.alpha_by_position).all()


# ---- speculative_generate --------------------------------------------------------------------------

PROMPT = stdlib_prompts([48], seed=3)[0]
_GREEDY: dict = {}


def greedy_alone(target, prompt, n: int, name: str) -> list[int]:
    key = (tuple(prompt), n, name)
    if key not in _GREEDY:
        _GREEDY[key] = generate(target, prompt, n, temperature=0, backend=backends.resolve(name)).new_tokens
    return _GREEDY[key]


def make_drafter(kind: str, draft, name: str) -> Drafter:
    return ModelDrafter(draft, backend=backends.resolve(name)) if kind == "model" else PromptLookupDrafter(256)


# Every γ on torch, a subset on numba (whose numpy matmuls are slow on a 2-core machine, where
# OpenBLAS's threads and numba's contend).
GREEDY_CASES = [("torch", kind, range(1, 9)) for kind in ("model", "lookup")] + [
    ("numba", "model", (2, 5)), ("numba", "lookup", range(1, 9))]


@pytest.mark.parametrize("name, kind, gammas", GREEDY_CASES)
def test_speculative_greedy_is_the_targets_greedy(target, draft, name, gammas, kind):
    backend, n = backends.resolve(name), 24
    expected = greedy_alone(target, PROMPT, n, name)
    rejected = 0
    for gamma in gammas:
        drafter = make_drafter(kind, draft, name)
        out = speculative_generate(target, drafter, PROMPT, gamma, n, backend=backend)
        assert out.new_tokens == expected, (gamma, kind, name)
        assert out.prompt_tokens == PROMPT and out.target_forwards == 1 + len(out.rounds)
        assert [t for r in out.rounds for t in r.emitted] == expected[1:]
        assert all(len(r.drafted) <= gamma and r.emitted[:r.accepted] == r.drafted[:r.accepted]
                   for r in out.rounds)
        drafted = [r for r in out.rounds if r.drafted]  # plain decodes (no draft found, or room for none) aside
        assert out.tally.rounds == len(drafted) and out.tally.kept.sum() == sum(r.accepted for r in drafted)
        rejected += int(out.tally.reached.sum() - out.tally.kept.sum())
        if kind == "model":
            assert not drafter.seqs and drafter.pool.num_free == drafter.pool.allocator.num_blocks
    assert rejected > 0  # the rejection path ran: the check above is not one of all-accepted drafts


def test_speculative_greedy_stops_at_a_stop_token(target, draft):
    expected = greedy_alone(target, PROMPT, 24, "torch")
    stop = expected[10]
    out = speculative_generate(target, ModelDrafter(draft, backend=backends.resolve("torch")), PROMPT, 4, 24,
                               SamplingParams(max_tokens=24, stop_tokens=(stop,)), backends.resolve("torch"))
    assert out.new_tokens == expected[:expected.index(stop) + 1]


def test_speculative_sampling_is_deterministic_for_a_seed(target, draft):
    backend = backends.resolve("torch")
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=5, max_tokens=24)
    runs = [speculative_generate(target, ModelDrafter(draft, backend=backend), PROMPT, 3, 24, params, backend)
            for _ in range(2)]
    assert runs[0].new_tokens == runs[1].new_tokens and len(runs[0].new_tokens) == 24
    other = speculative_generate(target, ModelDrafter(draft, backend=backend), PROMPT, 3, 24,
                                 SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=6), backend)
    assert other.new_tokens != runs[0].new_tokens


@pytest.mark.parametrize("seed", [1, 3])
def test_the_theory_predicts_tokens_per_forward_in_a_run(target, draft, seed):
    """γ = 4, greedy, 200 tokens: the measured tokens per target forward is within 5% of
    (1 - α^5) / (1 - α) at the measured α (on these prompts: 3.41 against 3.55, -3.9%; 4.15
    against 4.17, -0.7%). The theory assumes each draft is kept independently with the same α;
    here the first position is kept least often, so the run falls a little short of it."""
    gamma, prompt = 4, stdlib_prompts([64], seed=seed)[0]
    out = speculative_generate(target, ModelDrafter(draft, backend=backends.resolve("torch")), prompt, gamma, 200,
                               backend=backends.resolve("torch"))
    tally = out.tally
    assert 0.5 < tally.alpha < 0.95  # drafts are rejected: the formula is tested away from its ends
    assert tally.tokens_per_forward == pytest.approx(expected_tokens(tally.alpha, gamma), rel=0.05)


# ---- bad input ----------------------------------------------------------------------------------------


class Fixed(Drafter):
    """Proposes the same draft whatever it is asked."""
    name = "fixed"

    def __init__(self, draft: Draft, vocab: int = 256):
        self.draft, self.vocab = draft, vocab

    def propose(self, jobs):
        return [self.draft for _ in jobs]


@pytest.mark.parametrize("gamma", BAD_GAMMAS)
def test_speculative_generate_refuses_a_bad_gamma(target, gamma):
    with pytest.raises(ValueError, match="gamma .* must be an integer >= 1"):
        speculative_generate(target, PromptLookupDrafter(256), PROMPT, gamma, 8)


@pytest.mark.parametrize("drafter, message", [
    (lambda: Fixed(Draft((300,))), r"fixed drafter proposed token 300, outside the vocabulary \[0, 256\)"),
    (lambda: Fixed(Draft((-1,))), r"proposed token -1, outside the vocabulary"),
    (lambda: Fixed(Draft((1, 2, 3, 4))), "must return a Draft of at most 3 tokens"),
    (lambda: Fixed((1, 2)), "must return a Draft of at most 3 tokens"),
    (lambda: Fixed(Draft((1,), np.full((2, 256), 1 / 256))), r"q must be \(1, 256\), a row per drafted token"),
    (lambda: Fixed(Draft((1.0,))), "proposed token 1.0"),
    (lambda: ModelDrafter(tiny_model(128)), "vocabulary has 128 tokens but the target's has 256"),
    (lambda: object(), "need a Drafter"),
])
def test_speculative_generate_refuses_a_bad_drafter_by_name(target, drafter, message):
    with pytest.raises((ValueError, TypeError), match=message):
        speculative_generate(target, drafter(), PROMPT, 3, 8)


def test_speculative_generate_refuses_a_bad_length(target):
    with pytest.raises(ValueError, match="need a non-empty prompt and 1 <= max_new_tokens"):
        speculative_generate(target, PromptLookupDrafter(256), [], 3, 8)
    with pytest.raises(ValueError, match="1 <= max_new_tokens <= 464"):
        speculative_generate(target, PromptLookupDrafter(256), PROMPT, 3, 465)
    with pytest.raises(ValueError, match="got 0"):
        speculative_generate(target, PromptLookupDrafter(256), PROMPT, 3, 0)
