"""Chapter 07's checks: plausible wrong answers fail and say how, the cases
cover what the statements promise, and a correct rule that draws its random numbers in another
order passes too."""
import dataclasses
import zlib

import numpy as np
import pytest

from infra_lab.grading import ch07, checks
from infra_lab.kv.paged import PagedKVCache
from infra_lab.serving import speculative
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.speculative import Verdict


def run(name, candidate, spec=None):
    return checks._run(spec or checks._lookup(f"ch07.{name}"), candidate)


def cases(name):
    spec = checks._lookup(f"ch07.{name}")
    rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
    return [spec.draw_case(rng) for _ in range(spec.n_cases)]


RULE_CASES = [case for case in cases("accept_sampling") if not case[0].startswith("engine")]
ENGINE_CASES = [case for case in cases("accept_sampling") if case[0].startswith("engine")]


def rule_only():
    """The sampling check without its engine cases (they come last in its schedule)."""
    spec = checks._lookup("ch07.accept_sampling")
    return dataclasses.replace(spec, n_cases=len(RULE_CASES))


def failures(rule, chosen=RULE_CASES):
    found = []
    for case in chosen:
        try:
            ch07.drive_sampling(rule, *case)
        except Exception as error:
            found.append(f"{type(error).__name__}: {error}")
    return found


def test_the_cases_cover_the_edges_the_statements_name():
    alphas = [alpha for alpha, _ in cases("expected_tokens")]
    assert 0.0 in alphas and 1.0 in alphas
    best = [(alpha, c, max_gamma) for alpha, c, max_gamma in cases("best_gamma")]
    assert (0.0, 0.0) in [(a, c) for a, c, _ in best] and (1.0, 1.0) in [(a, c) for a, c, _ in best]
    assert any(c == 0 and 0 < a < 1 for a, c, _ in best) and any(m == 1 for _, _, m in best)
    verdicts = [speculative.accept_greedy(np.array(target), drafted) for target, drafted in cases("verify_greedy")]
    drafted = [len(d) for _, d in cases("verify_greedy")]
    assert 0 in drafted
    assert any(v.accepted == 0 < k for v, k in zip(verdicts, drafted))
    assert any(v.accepted == k > 0 for v, k in zip(verdicts, drafted))
    rollbacks = cases("rollback")
    assert {case[0] for case in rollbacks} == {1, 4, 16}
    ends = [(computed + 1 + accepted) % size for size, computed, _, accepted, _, _ in rollbacks if size > 1]
    assert 0 in ends and 1 in ends
    kinds = [case[0] for case in cases("accept_sampling")]
    assert kinds == ch07._SAMPLING_KINDS
    assert kinds.count("engine, first two tokens") == 1 and kinds[-1].startswith("engine")


def test_a_new_generator_starts_the_schedule_again():
    first, again = cases("accept_sampling"), cases("accept_sampling")
    assert [c[:2] for c in first] == [c[:2] for c in again]


# ---- the speed-up model ---------------------------------------------------------------------------

def one_token_short(alpha, gamma):
    return float(gamma) if alpha == 1 else (1 - alpha ** gamma) / (1 - alpha)


def no_bonus_at_one(alpha, gamma):
    return float(gamma) if alpha == 1 else speculative.expected_tokens(alpha, gamma)


@pytest.mark.parametrize("wrong", [one_token_short, no_bonus_at_one])
def test_wrong_expected_tokens_fail(wrong):
    result = run("expected_tokens", wrong)
    assert result.passed < result.total
    assert "returned" in result.first_failure and "expected" in result.first_failure, result.first_failure


def largest_on_a_tie(alpha, c, max_gamma):
    best = 1
    for gamma in range(1, max_gamma + 1):
        if speculative.speedup(alpha, gamma, c) >= speculative.speedup(alpha, best, c):
            best = gamma
    return best


def ignores_the_drafter_cost(alpha, c, max_gamma):
    return speculative.best_gamma(alpha, 0.0, max_gamma)


def most_tokens(alpha, c, max_gamma):
    return max(range(1, max_gamma + 1), key=lambda g: speculative.expected_tokens(alpha, g))


@pytest.mark.parametrize("wrong, shows", [
    (largest_on_a_tie, "best_gamma(0, 0,"), (ignores_the_drafter_cost, "best_gamma("), (most_tokens, "best_gamma("),
])
def test_wrong_best_gamma_fails(wrong, shows):
    result = run("best_gamma", wrong)
    assert result.passed < result.total
    assert result.first_failure.startswith(shows) and "expected" in result.first_failure, result.first_failure


# ---- the greedy verdict ------------------------------------------------------------------------------

def keeps_the_mismatch(target_tokens, drafted):
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == target_tokens[accepted]:
        accepted += 1
    accepted = min(accepted + 1, len(drafted))
    return Verdict(accepted, tuple(drafted[:accepted]) + (int(target_tokens[accepted]),))


def counts_every_agreement(target_tokens, drafted):
    accepted = sum(int(d == t) for d, t in zip(drafted, target_tokens))
    return Verdict(accepted, tuple(drafted[:accepted]) + (int(target_tokens[accepted]),))


def no_bonus(target_tokens, drafted):
    verdict = speculative.accept_greedy(target_tokens, drafted)
    return Verdict(verdict.accepted, verdict.tokens[:len(drafted)] if verdict.accepted == len(drafted) else
                   verdict.tokens)


@pytest.mark.parametrize("wrong, where", [(keeps_the_mismatch, "(accepted)"), (counts_every_agreement, "(accepted)"),
                                          (no_bonus, "(tokens)")])
def test_wrong_greedy_verdicts_fail_naming_the_field(wrong, where):
    result = run("verify_greedy", wrong)
    assert result.passed < result.total
    assert where in result.first_failure, result.first_failure


def test_a_greedy_verdict_that_is_not_a_verdict_is_named():
    result = run("verify_greedy", lambda target, drafted: (0, (int(target[0]),)))
    assert result.passed == 0 and "must return Verdict(accepted, tokens)" in result.first_failure


# ---- the rollback ---------------------------------------------------------------------------------

def forgets_the_fed_token(pool, seq, computed_before, drafted, accepted):
    return ch07.rollback(pool, seq, computed_before - 1, drafted, accepted)


def keeps_the_targets_token(pool, seq, computed_before, drafted, accepted):
    return ch07.rollback(pool, seq, computed_before + 1, drafted, accepted)


def keeps_the_rejected_draft(pool, seq, computed_before, drafted, accepted):
    return ch07.rollback(pool, seq, computed_before + (accepted < drafted), drafted, accepted)


def frees_no_blocks(pool, seq, computed_before, drafted, accepted):
    length = computed_before + 1 + accepted
    pool.lengths[seq] = length
    del pool.tokens[seq][length:]
    return 0


def counts_blocks_wrong(pool, seq, computed_before, drafted, accepted):
    ch07.rollback(pool, seq, computed_before, drafted, accepted)
    return drafted - accepted  # tokens, not blocks


@pytest.mark.parametrize("wrong, where", [
    (forgets_the_fed_token, "(length)"), (keeps_the_targets_token, "(length)"),
    (keeps_the_rejected_draft, "(length)"), (frees_no_blocks, "(blocks in its table)"),
    (counts_blocks_wrong, "(returned)"),
])
def test_wrong_rollbacks_fail_naming_the_field(wrong, where):
    result = run("rollback", wrong)
    assert result.passed < result.total
    assert "first difference at item [" in result.first_failure and where in result.first_failure, \
        result.first_failure


def test_the_rollback_reference_truncates_with_the_package(monkeypatch):
    calls = []
    original = PagedKVCache.truncate
    monkeypatch.setattr(PagedKVCache, "truncate", lambda self, seq, n: calls.append(n) or original(self, seq, n))
    log = ch07.drive_rollback(ch07.rollback, 4, 6, 3, 1, [5], 0)  # 10 tokens in 3 blocks, 8 kept in 2
    assert calls == [8]
    assert dict(log)["length"] == 8 and dict(log)["returned"] == 1 and dict(log)["free blocks"] == 1


# ---- speculative sampling, as a rule ------------------------------------------------------------------

def redraws_from_p(p, drafted, q, rng):
    vocab = p.shape[1]
    for i, x in enumerate(drafted):
        q_i = q[i] if q is not None else np.eye(vocab)[x]
        if rng.random() < p[i, x] / q_i[x]:
            continue
        return Verdict(i, tuple(drafted[:i]) + (int(rng.choice(vocab, p=p[i])),))
    return Verdict(len(drafted), tuple(drafted) + (int(rng.choice(vocab, p=p[-1])),))


def keeps_if_p_is_larger(p, drafted, q, rng):
    """No coin: a draft is kept when p(x) >= q(x), never with probability p/q."""
    vocab = p.shape[1]
    for i, x in enumerate(drafted):
        q_i = q[i] if q is not None else np.eye(vocab)[x]
        if p[i, x] >= q_i[x]:
            continue
        residual = np.maximum(p[i] - q_i, 0)
        return Verdict(i, tuple(drafted[:i]) + (int(rng.choice(vocab, p=residual / residual.sum())),))
    return Verdict(len(drafted), tuple(drafted) + (int(rng.choice(vocab, p=p[-1])),))


def bonus_from_the_first_row(p, drafted, q, rng):
    verdict = speculative.accept_sampling(p, drafted, q, rng)
    if drafted and verdict.accepted == len(drafted):
        return Verdict(verdict.accepted, verdict.tokens[:-1] + (int(rng.choice(p.shape[1], p=p[0])),))
    return verdict


def always_rejects(p, drafted, q, rng):
    """Never keeps a draft: the first is always replaced from the residual."""
    if not drafted:
        return Verdict(0, (int(rng.choice(p.shape[1], p=p[0])),))
    q_0 = q[0] if q is not None else np.eye(p.shape[1])[drafted[0]]
    residual = np.maximum(p[0] - q_0, 0)
    residual = residual / residual.sum() if residual.sum() > 0 else p[0]
    return Verdict(0, (int(rng.choice(p.shape[1], p=residual)),))


@pytest.mark.parametrize("wrong, says", [
    (redraws_from_p, "redraws a rejected token from p"),
    (speculative.accept_all, "the target never emits it there"),
    (keeps_if_p_is_larger, "is not distributed as p[0]"),
    (bonus_from_the_first_row, "the target never emits it there"),
    (always_rejects, "with q == p a draft is always kept"),
])
def test_wrong_sampling_rules_fail_in_plain_words(wrong, says):
    found = failures(wrong)
    assert found and says in found[0], found[:1]


def test_a_failing_rule_gets_one_line_with_the_case_and_the_cause():
    result = run("accept_sampling", redraws_from_p, rule_only())
    assert result.passed < result.total
    assert result.line.startswith("FAIL ch07.accept_sampling ") and "raised WrongVerdicts: over 2000 verdicts" in \
        result.line and "draw it from the residual norm(max(0, p - q)) instead" in result.line, result.line


def test_each_statistical_failure_names_its_cause():
    assert any("follow the drafter's q" in f for f in failures(speculative.accept_all))
    assert any("once every draft is kept, the extra token" in f for f in failures(bonus_from_the_first_row))


def draws_in_another_order(p, drafted, q, rng):
    """Correct, but with its own use of the generator: a uniform from the top, and inverse-CDF
    draws instead of rng.choice."""
    vocab = p.shape[1]

    def draw(weights):
        cumulative = np.cumsum(weights)
        return int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))

    for i, x in enumerate(drafted):
        q_i = q[i] if q is not None else np.eye(vocab)[x]
        if (1.0 - rng.random()) * q_i[x] <= p[i, x]:
            continue
        return Verdict(i, tuple(drafted[:i]) + (draw(np.maximum(p[i] - q_i, 0)),))
    return Verdict(len(drafted), tuple(drafted) + (draw(p[len(drafted)]),))


def test_a_correct_rule_that_draws_differently_passes():
    result = run("accept_sampling", draws_in_another_order, rule_only())
    assert result.passed == result.total, result.first_failure


def test_a_verdict_that_drops_its_own_token_is_named():
    def drops(p, drafted, q, rng):
        verdict = speculative.accept_sampling(p, drafted, q, rng)
        return Verdict(verdict.accepted, verdict.tokens[:-1])

    assert all("adds exactly one token of the target's" in f for f in failures(drops))


# ---- speculative sampling, inside the engine ----------------------------------------------------------

def test_at_top_k_one_the_reference_serves_the_targets_greedy_tokens():
    for case in [c for c in ENGINE_CASES if c[0] == "engine, top-k 1"]:
        prompts, gamma, max_tokens = case[1]
        log = ch07.drive_sampling(ch07.accept_sampling, *case)
        plain = Engine(ch07._models()[0], EngineConfig(policy="chunked"), ch07.serving_backend())
        greedy = plain.generate(list(prompts), [SamplingParams(max_tokens=m) for m in max_tokens])
        assert [text for _, text in log[1:]] == [bytes(g).decode("latin-1") for g in greedy]


def test_keeping_every_draft_changes_the_greedy_tokens():
    outcomes = [(ch07.drive_sampling(speculative.accept_all, *c), ch07.drive_sampling(ch07.accept_sampling, *c))
                for c in ENGINE_CASES if c[0] == "engine, top-k 1"]
    assert any(wrong != right for wrong, right in outcomes)


@pytest.mark.parametrize("wrong, says", [
    (speculative.accept_all, "follow the drafter's q"),
    (redraws_from_p, "redraws a rejected token from p"),
])
def test_the_engine_fit_rejects_wrong_rules(wrong, says):
    (case,) = [c for c in ENGINE_CASES if c[0] == "engine, first two tokens"]
    (found,) = failures(wrong, [case])
    assert found.startswith("WrongVerdicts: served through the engine") and says in found, found
    assert float(found.split("chi-square p = ")[1].split(",")[0]) < 1e-9  # far below P_MIN, not near it
