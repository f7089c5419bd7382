"""Speculative decoding (chapter 07): a drafter guesses γ tokens, the target checks them all in
one forward, and keeps the longest prefix it agrees with, plus one token of its own.

A decode step reads every weight for one token (chapter 01); verifying γ drafted tokens reads
them once for γ + 1 (Leviathan, Kalman and Matias, "Fast Inference from Transformers via
Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling", 2023). The output is the target's, exactly:
- greedy (temperature 0): accept drafted tokens while each equals the target's argmax; the first
  that differs is replaced by that argmax;
- sampling: accept token x with probability min(1, p(x) / q(x)), where p is the target's and q
  the drafter's distribution (top-k and top-p applied to both); on a rejection draw from the
  residual norm(max(0, p - q)). Every emitted token is then distributed as p.
Either way, if all γ are accepted the target's row after the last one gives a bonus token.

Theory (Leviathan et al., section 3): with α the chance a drafted token is accepted and c the
cost of a drafter step relative to a target step, one target forward yields on average
(1 - α^(γ+1)) / (1 - α) tokens, and the wall-clock speed-up is that over (γ c + 1).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from infra_lab import backend as backends
from infra_lab.model import tokenizer
from infra_lab.model.generate import Generation, distribution, sample
from infra_lab.serving.drafters import Draft, Drafter, DraftJob
from infra_lab.serving.request import SamplingParams

# ---- theory ------------------------------------------------------------------------------------


def check_gamma(gamma) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise ValueError(f"gamma (tokens drafted per step) must be an integer >= 1; got {gamma!r}")
    return int(gamma)


def _check_alpha(alpha: float) -> None:
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha (the acceptance rate) must be in [0, 1]; got {alpha}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens one target forward yields: (1 - α^(γ+1)) / (1 - α), γ + 1 at α = 1."""
    _check_alpha(alpha)
    gamma = check_gamma(gamma)
    return gamma + 1.0 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al.'s expected wall-clock speed-up: expected tokens over (γ c + 1)."""
    if c < 0:
        raise ValueError(f"c (a drafter step's cost relative to a target step) must be >= 0; got {c}")
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def best_gamma(alpha: float, c: float, max_gamma: int = 16) -> int:
    """The γ in 1..max_gamma with the highest expected speed-up (the smallest such γ on a tie)."""
    return max(range(1, check_gamma(max_gamma) + 1), key=lambda g: speedup(alpha, g, c))


# ---- acceptance -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafted tokens kept
    tokens: tuple[int, ...]  # what comes out: the kept drafts, then the target's own token


def accept(logits: np.ndarray, draft: Draft, params: SamplingParams, rng: np.random.Generator,
           rule=None) -> Verdict:
    """The target's verdict on `draft`, from its logits (k + 1, vocab) at the position before each
    drafted token and after the last: greedy at temperature 0, else `rule(p, drafted, q, rng)`
    (speculative sampling, `accept_sampling`, unless another rule is given) on the target's
    distributions p, with the sampling parameters' temperature, top-k and top-p."""
    k, vocab = len(draft), logits.shape[-1]
    if logits.shape != (k + 1, vocab):
        raise ValueError(f"need the target's logits for the {k} drafted tokens plus one, ({k + 1}, vocab); "
                         f"got {logits.shape}")
    bad = [t for t in draft.tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"the drafter proposed token {bad[0]}, outside the vocabulary [0, {vocab})")
    if params.temperature == 0:
        return accept_greedy(logits.argmax(axis=1), draft.tokens)
    p = np.array([distribution(row, params.temperature, params.top_k, params.top_p) for row in logits])
    return (rule or accept_sampling)(p, draft.tokens, draft.q, rng)


def accept_greedy(target_tokens: np.ndarray, drafted) -> Verdict:
    """target_tokens (k + 1,): the target's argmax after each prefix. Keep drafts while they agree."""
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == target_tokens[accepted]:
        accepted += 1
    return Verdict(accepted, tuple(int(t) for t in drafted[:accepted]) + (int(target_tokens[accepted]),))


def accept_sampling(p: np.ndarray, drafted, q: np.ndarray | None, rng: np.random.Generator) -> Verdict:
    """p (k + 1, vocab) the target's distributions, q (k, vocab) the drafter's (None: a point mass
    on each drafted token). Token i is kept with probability min(1, p_i(x) / q_i(x)); the first
    rejected one is replaced by a draw from norm(max(0, p_i - q_i))."""
    vocab = p.shape[1]
    for i, token in enumerate(drafted):
        q_i = q[i] if q is not None else np.eye(1, vocab, token)[0]
        if q_i[token] <= 0:
            raise ValueError(f"the drafter proposed token {token} at position {i} with probability 0 in its own q")
        if rng.random() * q_i[token] < p[i, token]:  # accepted with probability min(1, p/q)
            continue
        residual = np.maximum(p[i] - q_i, 0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        return Verdict(i, tuple(int(t) for t in drafted[:i]) + (int(rng.choice(vocab, p=residual)),))
    return Verdict(len(drafted), tuple(int(t) for t in drafted) + (int(rng.choice(vocab, p=p[-1])),))


def accept_all(p: np.ndarray, drafted, q, rng: np.random.Generator) -> Verdict:
    """A wrong rule, for the statistical test to catch: every draft is kept."""
    return Verdict(len(drafted), tuple(int(t) for t in drafted) + (int(rng.choice(p.shape[1], p=p[-1])),))


# ---- what a run measured ------------------------------------------------------------------------


@dataclass
class Tally:
    """Drafted and accepted tokens of a run, per position: α, and tokens per target forward."""
    gamma: int
    rounds: int = 0  # target forwards that verified a draft (plain steps with no draft are left out)
    emitted: int = 0  # tokens those forwards produced
    reached: np.ndarray = field(init=False)  # (γ,) rounds in which position i was checked
    kept: np.ndarray = field(init=False)  # (γ,) rounds in which position i was accepted

    def __post_init__(self):
        self.reached, self.kept = np.zeros(self.gamma, np.int64), np.zeros(self.gamma, np.int64)

    def add(self, drafted: int, verdict: Verdict) -> None:
        if drafted == 0:
            return
        self.rounds += 1
        self.emitted += len(verdict.tokens)
        checked = min(verdict.accepted + 1, drafted)  # the accepted ones, and the first rejected one
        self.reached[:checked] += 1
        self.kept[:verdict.accepted] += 1

    @property
    def alpha(self) -> float:
        """Accepted over checked drafted tokens: the chance a drafted token is kept once reached."""
        return float(self.kept.sum() / self.reached.sum()) if self.reached.sum() else float("nan")

    @property
    def alpha_by_position(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.kept / self.reached

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.rounds if self.rounds else float("nan")


# ---- one sequence, outside the engine -------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """One target forward of a run: what was drafted, how much of it the target kept, what came out."""
    drafted: tuple[int, ...]
    accepted: int
    emitted: tuple[int, ...]  # the kept drafts, then the target's own token (cut at a stop or max_new_tokens)
    draft_s: float
    verify_s: float


@dataclass(frozen=True)
class SpeculativeGeneration(Generation):
    """A generation (text, tokens/s), with where its time went and what its rounds kept."""
    draft_s: float  # in the drafter
    target_s: float  # in the target's forwards
    target_forwards: int
    tally: Tally
    rounds: list[Round]  # the forwards after the prompt's, in order


def speculative_generate(target, drafter: Drafter, prompt, gamma: int, max_new_tokens: int = 64,
                         params: SamplingParams | None = None,
                         backend: backends.Backend | None = None) -> SpeculativeGeneration:
    """Continue `prompt` by `max_new_tokens` tokens (fewer at a stop token), drafting up to γ per
    target forward. At temperature 0 the tokens are the target's greedy ones; at temperature > 0
    they are distributed as the target's samples (not the same draws: the rule uses the random
    stream differently). The target's cache rolls back rejected drafts with `truncate`."""
    gamma = check_gamma(gamma)
    check_drafter(drafter, target)
    params = params or SamplingParams(max_tokens=max_new_tokens)
    tokens = list(tokenizer.encode(prompt)) if isinstance(prompt, (str, bytes)) else [int(t) for t in prompt]
    context = target.config.context
    if not tokens or max_new_tokens < 1 or len(tokens) + max_new_tokens > context:
        raise ValueError(f"need a non-empty prompt and 1 <= max_new_tokens <= {context - len(tokens)} (the "
                         f"context of {context} minus the prompt's {len(tokens)}); got {max_new_tokens}")
    backend = backend or backends.current()
    rng, tally = np.random.default_rng(params.seed), Tally(gamma)
    cache = target.new_cache(backend=backend)
    started = time.perf_counter()
    logits = target.forward(tokens, cache, backend)[-1]
    new = [sample(logits, params.temperature, params.top_k, params.top_p, rng)]
    draft_s, target_s, forwards, rounds = 0.0, 0.0, 1, []
    try:
        while len(new) < max_new_tokens and new[-1] not in params.stop_tokens:
            sequence = tokens + new
            k = min(gamma, max_new_tokens - len(new) - 1)  # the bonus token fills the last place
            tick = time.perf_counter()
            draft = check_draft(drafter.propose([DraftJob(0, sequence, k, params, rng)])[0], k, drafter) \
                if k else Draft(())
            tock = time.perf_counter()
            rows = target.forward([sequence[-1], *draft.tokens], cache, backend)  # (1 + k', vocab)
            verdict = accept(rows, draft, params, rng)
            cache.cache.truncate(cache.seq, len(sequence) + verdict.accepted)  # rejected drafts leave
            done = time.perf_counter()
            draft_s, target_s, forwards = draft_s + tock - tick, target_s + done - tock, forwards + 1
            tally.add(len(draft), verdict)
            before = len(new)
            for token in verdict.tokens:
                new.append(token)
                if token in params.stop_tokens or len(new) == max_new_tokens:
                    break
            rounds.append(Round(draft.tokens, verdict.accepted, tuple(new[before:]), tock - tick, done - tock))
    finally:
        drafter.retain(())
    return SpeculativeGeneration(tokens, new, time.perf_counter() - started, draft_s, target_s, forwards, tally,
                                 rounds)


def check_drafter(drafter: Drafter, target) -> None:
    if not isinstance(drafter, Drafter):
        raise TypeError(f"need a Drafter (ModelDrafter, PromptLookupDrafter); got {type(drafter).__name__}")
    if drafter.vocab != target.config.vocab:
        raise ValueError(f"the {drafter.name} drafter's vocabulary has {drafter.vocab} tokens but the target's has "
                         f"{target.config.vocab}: a draft must speak the target's tokens")


def check_draft(draft: Draft, k: int, drafter: Drafter) -> Draft:
    """A draft of at most k tokens, each in the vocabulary, with a q row per token if any: a
    distribution that gives its token a chance (accept_sampling divides by it)."""
    if not isinstance(draft, Draft) or len(draft) > k:
        raise ValueError(f"the {drafter.name} drafter must return a Draft of at most {k} tokens; got {draft!r}")
    bad = [t for t in draft.tokens if not isinstance(t, (int, np.integer)) or not 0 <= t < drafter.vocab]
    if bad:
        raise ValueError(f"the {drafter.name} drafter proposed token {bad[0]!r}, outside the vocabulary "
                         f"[0, {drafter.vocab})")
    if draft.q is not None:
        if np.shape(draft.q) != (len(draft), drafter.vocab):
            raise ValueError(f"the {drafter.name} drafter's q must be ({len(draft)}, {drafter.vocab}), a row per "
                             f"drafted token; got {np.shape(draft.q)}")
        q = np.asarray(draft.q, np.float64)
        sums = q.sum(axis=1) if len(draft) else np.ones(0)
        if not np.isfinite(q).all() or (q < 0).any() or not np.allclose(sums, 1, atol=1e-6):
            raise ValueError(f"the {drafter.name} drafter's q rows must be distributions (non-negative, summing to "
                             f"1); got row sums {np.round(sums, 6).tolist()}")
        unlikely = [i for i, t in enumerate(draft.tokens) if q[i, t] <= 0]
        if unlikely:  # caught here, before the target's forward, not halfway through a step's verdicts
            i = unlikely[0]
            raise ValueError(f"the {drafter.name} drafter proposed token {draft.tokens[i]} at position {i} with "
                             "probability 0 in its own q")
    return draft
