"""Checks for chapter 07's exercises: the speed-up model (tokens per target forward, the best
γ), the greedy verdict, rolling a paged sequence back past its rejected drafts, and speculative
sampling, as a rule and inside the engine.

The references call the package: `infra_lab.serving.speculative`, `PagedKVCache.truncate`, and
`Engine` with a `ModelDrafter`. Speculative sampling is checked by what it promises, not draw by
draw, since a correct rule may use its random generator in any order: run on made-up
distributions thousands of times, every token it emits must be distributed as the target's p
(Pearson's chi-square, `exactness.fit`), and a few cases have a certain outcome (q = p keeps
every draft; a draft where p is 0 is always rejected). Then the rule serves the real target
through the engine: at top-k 1 its tokens must be the target's greedy ones, and the first two
tokens of hundreds of requests must fit the target's exact distribution. Every case is drawn
from plain numbers, so a failure line shows them.
"""
from __future__ import annotations

import functools

import numpy as np

from infra_lab.grading.ch05 import serving_backend
from infra_lab.grading.checks import Check, register
from infra_lab.kv.paged import PagedKVCache
from infra_lab.model.generate import distribution
from infra_lab.serving import exactness, speculative
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.drafters import ModelDrafter
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.speculative import Verdict

P_MIN = 1e-6  # a fit below this fails: a correct rule fails one test in a million, a wrong one far below
RULE_TRIALS = 2_000  # verdicts per statistical case of the rule alone
SURE_TRIALS = 200  # verdicts per case whose outcome is certain
MIN_REACHED = 200  # a position is tested only if this many verdicts reach it
ENGINE_SAMPLES = 256  # requests in the engine's fit (four waves of 64): 1 to 3 s here
ENGINE_PROMPTS = ("from ", "import ", "if ")  # where the draft model's q is far from p at top-k 4


class Schedule:
    """A draw_case whose cases come in a fixed order of kinds: the i-th draw from one generator
    is `draw(kinds[i], rng)`. A new generator (each run of a check) starts the order again."""

    def __init__(self, kinds: list[str], draw):
        self.kinds, self.draw = kinds, draw
        self._rng, self._next = None, 0

    def __call__(self, rng: np.random.Generator) -> tuple:
        if rng is not self._rng:  # holding the old one keeps its id from being reused
            self._rng, self._next = rng, 0
        kind = self.kinds[self._next % len(self.kinds)]
        self._next += 1
        return self.draw(kind, rng)


class WrongVerdicts(AssertionError):
    """A rule's verdicts break what speculative sampling promises (the failure line says how)."""


# ---- exercises 1 and 2: the speed-up model ------------------------------------------------------

def expected_tokens(alpha, gamma):
    """Reference: tokens per target forward, (1 - α^(γ+1)) / (1 - α), γ + 1 at α = 1."""
    return speculative.expected_tokens(alpha, gamma)


def best_gamma(alpha, c, max_gamma):
    """Reference: the γ in 1..max_gamma with the highest speed-up, the smallest on a tie."""
    return speculative.best_gamma(alpha, c, max_gamma)


def _alpha(rng) -> float:
    return round(float(rng.uniform(0.0, 0.99)), 3)


def _expected_case(kind, rng):
    alpha = {"alpha 0": 0.0, "alpha 1": 1.0}.get(kind, None)
    return (_alpha(rng) if alpha is None else alpha), int(rng.integers(1, 17))


def _best_case(kind, rng):
    while True:
        alpha, c, max_gamma = _alpha(rng), round(float(rng.uniform(0.01, 1.5)), 3), int(rng.integers(2, 17))
        if kind == "c 0":
            c = 0.0
        elif kind == "alpha 0":
            alpha = 0.0
        elif kind == "alpha 1":
            alpha = 1.0
        elif kind == "tie: alpha 0, c 0":  # every γ gives 1: the smallest wins
            alpha, c = 0.0, 0.0
        elif kind == "tie: alpha 1, c 1":  # (γ + 1) / (γ + 1) = 1 for every γ
            alpha, c = 1.0, 1.0
        elif kind == "max_gamma 1":
            max_gamma = 1
        gains = sorted((speculative.speedup(alpha, g, c) for g in range(1, max_gamma + 1)), reverse=True)
        if len(gains) == 1 or gains[0] == gains[1] or gains[0] - gains[1] > 1e-9 * gains[0]:
            return alpha, c, max_gamma  # no near-tie that rounding could turn either way


_EXPECTED_KINDS = ["random", "alpha 1", "random", "alpha 0"] * 6
_BEST_KINDS = (["random", "c 0", "random", "alpha 1", "random", "tie: alpha 0, c 0", "random", "alpha 0",
                "random", "tie: alpha 1, c 1", "random", "max_gamma 1"] * 2)


# ---- exercise 3: the greedy verdict ------------------------------------------------------------

def verify_greedy(target_tokens, drafted):
    """Reference: keep the drafts while they equal the target's argmax, then its own token."""
    return speculative.accept_greedy(target_tokens, drafted)


def _verdict(verdict, name: str) -> Verdict:
    if not isinstance(verdict, Verdict):
        raise TypeError(f"{name} must return Verdict(accepted, tokens) (from infra_lab.serving.speculative); "
                        f"got {type(verdict).__name__} {verdict!r:.80}")
    return verdict


def drive_greedy(function, target_tokens, drafted):
    """The verdict on `drafted` given the target's argmax after each prefix (k + 1 tokens)."""
    verdict = _verdict(function(np.array(target_tokens, np.int64), tuple(drafted)), "verify_greedy")
    return ("accepted", int(verdict.accepted)), ("tokens", tuple(int(t) for t in verdict.tokens))


def _greedy_case(kind, rng):
    k = 0 if kind == "empty draft" else int(rng.integers(1, 6))
    target = [int(t) for t in rng.integers(32, 127, size=k + 1)]
    fixed = {"all agree": k, "empty draft": 0, "first differs": 0, "last differs": k - 1}
    miss = fixed[kind] if kind in fixed else int(rng.integers(0, k))  # the first draft the target disagrees with
    drafted = target[:k]
    if miss < k:
        drafted[miss] = int(32 + (target[miss] - 32 + rng.integers(1, 95)) % 95)  # any other token
        if kind != "agree again after a miss":
            drafted[miss + 1:] = [int(t) for t in rng.integers(32, 127, size=k - miss - 1)]
    return target, drafted


_GREEDY_KINDS = (["all agree", "one differs", "first differs", "agree again after a miss", "one differs",
                  "last differs", "empty draft", "one differs"] * 3)


# ---- exercise 4: rolling the cache back ----------------------------------------------------------

def rollback(pool, seq, computed_before, drafted, accepted):
    """Reference: keep the computed_before tokens, the one fed before the drafts and the kept
    drafts; the rest leave with `truncate`. Returns the blocks that went back to the pool."""
    free_before = pool.num_free
    pool.truncate(seq, computed_before + 1 + accepted)
    return pool.num_free - free_before


def _fill(pool: PagedKVCache, n_tokens: int, first_token: int) -> int:
    seq = pool.new_sequence()
    pool.reserve(seq, n_tokens)
    pool.commit(seq, [(first_token + 7 * i) % 256 for i in range(n_tokens)])
    return seq


def drive_rollback(function, block_size, computed_before, drafted, accepted, other_lengths, spare_blocks):
    """A pool of `block_size`-token blocks holding the other sequences, and ours between them
    after a step that fed one token and `drafted` drafts (computed_before + 1 + drafted tokens),
    with `spare_blocks` free. After the call: what it returned and the pool's state."""
    total = computed_before + 1 + drafted
    blocks = sum(-(-n // block_size) for n in [*other_lengths, total])
    pool = PagedKVCache(1, 1, 1, blocks + spare_blocks, block_size)  # bookkeeping only
    half = len(other_lengths) // 2
    before = [_fill(pool, n, 100 + i) for i, n in enumerate(other_lengths[:half])]
    seq = _fill(pool, total, 1)
    after = [_fill(pool, n, 200 + i) for i, n in enumerate(other_lengths[half:])]
    freed = function(pool, seq, computed_before, drafted, accepted)
    if not isinstance(freed, (int, np.integer)) or isinstance(freed, bool):
        raise TypeError(f"rollback must return how many blocks went back to the pool, an int; got {freed!r:.60}")
    return (("length", pool.lengths[seq]), ("tokens", tuple(pool.tokens[seq])),
            ("blocks in its table", len(pool.tables[seq])), ("free blocks", pool.num_free), ("returned", int(freed)),
            ("other sequences' lengths", tuple(pool.lengths[s] for s in before + after)))


def _rollback_case(kind, rng):
    block_size, kind = kind
    drafted = int(rng.integers(1, 9)) if kind != "long draft" else int(rng.integers(9, 17))
    fixed = {"none kept": 0, "all kept": drafted}
    accepted = fixed[kind] if kind in fixed else int(rng.integers(0, drafted + 1))
    blocks = int(rng.integers(1, 4))
    if kind == "kept ends at a block's end":  # computed_before + 1 + accepted = a whole number of blocks
        computed_before = max(blocks * block_size - 1 - accepted, 0)
    elif kind == "kept ends one past a block":
        computed_before = max(blocks * block_size - accepted, 0)
    elif kind == "drafts end at a block's end":  # the step filled its last block
        computed_before = max(blocks * block_size - 1 - drafted, 0)
    elif kind == "first step after a one-token prompt":
        computed_before = 0
    else:
        computed_before = int(rng.integers(0, 3 * block_size + 1))
    others = [int(n) for n in rng.integers(1, 2 * block_size + 2, size=int(rng.integers(0, 3)))]
    return block_size, computed_before, drafted, accepted, others, int(rng.integers(0, 3))


_ROLLBACK_KINDS = [(block_size, kind) for kind in
                   ["some kept", "none kept", "kept ends at a block's end", "all kept", "kept ends one past a block",
                    "drafts end at a block's end", "first step after a one-token prompt", "long draft"]
                   for block_size in (1, 4, 16)]


# ---- exercise 5: speculative sampling, as a rule --------------------------------------------------

def accept_sampling(p, drafted, q, rng):
    """Reference: the package's speculative sampling (Leviathan et al., 2023; Chen et al., 2023)."""
    return speculative.accept_sampling(p, drafted, q, rng)


def _show(row) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in row) + "]"


def _well_formed(verdict, drafted: tuple, p: np.ndarray) -> tuple[int, tuple[int, ...]]:
    """(accepted, tokens) of a verdict that keeps a prefix of the drafts and adds one token that
    the target could emit there; WrongVerdicts otherwise."""
    verdict = _verdict(verdict, "accept_sampling")
    try:
        accepted, tokens = int(verdict.accepted), tuple(int(t) for t in verdict.tokens)
    except (TypeError, ValueError):
        raise TypeError(f"a Verdict holds an int and a tuple of ints; got {verdict!r:.100}") from None
    k, vocab = len(drafted), p.shape[1]
    if not 0 <= accepted <= k or tokens[:-1] != tuple(drafted[:accepted]) or len(tokens) != accepted + 1:
        raise WrongVerdicts(f"for drafted {drafted} it returned {verdict}: a verdict keeps the first `accepted` "
                            f"drafts (0 <= accepted <= {k}) and adds exactly one token of the target's, so tokens "
                            "== drafted[:accepted] + (one token,)")
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab or p[i, token] == 0:
            what = "outside the vocabulary" if not 0 <= token < vocab else f"p[{i}][{token}] = 0"
            kept = "a kept draft" if i < accepted else "the target's token"
            raise WrongVerdicts(f"for drafted {drafted} it returned {verdict}, whose token {i} ({kept}) is {token}, "
                                f"{what}: the target never emits it there. A draft x is kept with probability "
                                "min(1, p(x) / q(x)), and a rejected one is replaced from norm(max(0, p - q)), "
                                "which is 0 wherever p is")
    return accepted, tokens


def _hint(observed: np.ndarray, p_row: np.ndarray, q_row: np.ndarray | None) -> str:
    """What a rule that emitted `observed` where `p_row` was due most likely did wrong."""
    if q_row is None:  # the token after the last draft
        return "once every draft is kept, the extra token is drawn from p's row after the last draft"
    redraw = np.minimum(p_row, q_row) + (1 - np.minimum(p_row, q_row).sum()) * p_row
    if exactness.fit(observed, q_row).p_value >= 1e-3:
        return ("they follow the drafter's q instead: is a draft x kept without the test "
                "u < p(x) / q(x)?")
    if exactness.fit(observed, redraw).p_value >= 1e-3:
        return ("they match a rule that redraws a rejected token from p, which emits the tokens q favours too "
                "often: draw it from the residual norm(max(0, p - q)) instead")
    return "keep draft x with probability min(1, p(x) / q(x)); replace the first rejected one from norm(max(0, p - q))"


def _run_rule(rule, p, q, drafted, trials, seed):
    """`trials` verdicts of `rule`: with q, each on drafts drawn from q (one row per position);
    without, on the fixed `drafted`. Returns p and q as arrays, the drafts, and each verdict's
    (accepted, tokens)."""
    p = np.array(p, np.float64)
    rng = np.random.default_rng(seed)
    if q is not None:
        q = np.array(q, np.float64)
        columns = [rng.choice(p.shape[1], size=trials, p=row) for row in q]  # (k, trials)
        drafts = [tuple(int(column[t]) for column in columns) for t in range(trials)]
    else:
        drafts = [tuple(drafted)] * trials
    results = [_well_formed(rule(p.copy(), d, None if q is None else q.copy(), rng), d, p) for d in drafts]
    return p, q, drafts, results


def _fit_positions(p, q, drafts, results, trials) -> None:
    """Every position i that enough verdicts reach (accepted >= i): token i must be distributed
    as p[i] (for i = k, the extra token after every draft was kept)."""
    k = len(drafts[0])
    for i in range(k + 1):
        reached = [tokens[i] for accepted, tokens in results if accepted >= i]
        if len(reached) < MIN_REACHED:
            continue
        observed = np.array(reached)
        test = exactness.fit(observed, p[i])
        if test.p_value < P_MIN:
            q_row = None if i == k else (q[i] if q is not None else np.eye(p.shape[1])[drafts[0][i]])
            frequencies = np.bincount(observed, minlength=p.shape[1]) / len(observed)
            where = "the first emitted token" if i == 0 else (
                f"token {i} (of the {len(reached)} verdicts that kept {i} draft{'s' * (i > 1)})")
            raise WrongVerdicts(f"over {trials} verdicts, {where} is not distributed as p[{i}] = {_show(p[i])}: it "
                                f"came out {_show(frequencies)} (chi-square p = {test.p_value:.1e}); "
                                f"{_hint(observed, p[i], q_row)}")


def _check_sure(what, drafts, results) -> None:
    """The cases whose outcome is certain: every draft kept, or the first always rejected."""
    k = len(drafts[0])
    for d, (accepted, _) in zip(drafts, results):
        if what in ("p == q", "point mass p is sure of") and accepted != k:
            why = ("with q == p a draft is always kept (u < p(x) / q(x) = 1)" if what == "p == q" else
                   "p gives each drafted token probability 1, so each is kept")
            raise WrongVerdicts(f"{why}, but for drafted {d} it kept {accepted} of {k}")
        if what in ("q where p is 0", "point mass where p is 0") and accepted != 0:
            raise WrongVerdicts(f"drafted token {d[0]} has p[0][{d[0]}] = 0, so it must be rejected (kept with "
                                f"probability p / q = 0), but for drafted {d} it kept {accepted}")


_SURE = ("p == q", "q where p is 0", "point mass where p is 0", "point mass p is sure of")


def drive_sampling(rule, what, p, q, drafted, seed):
    """Run `rule` on the case: `what` names it; p (k + 1 rows) and q (k rows, or None for point
    masses on `drafted`) are the distributions. Returns what a correct rule shows (the same for
    every correct rule); raises WrongVerdicts naming the first broken promise."""
    if what.startswith("engine"):
        return _drive_engine(rule, what, *p)  # p holds the engine case's numbers
    trials = SURE_TRIALS if what in _SURE else RULE_TRIALS
    p, q, drafts, results = _run_rule(rule, p, q, drafted, trials, seed)
    if what in _SURE:
        _check_sure(what, drafts, results)
        return what, f"{trials} verdicts", "as certain"
    _fit_positions(p, q, drafts, results, trials)
    return what, f"{trials} verdicts", "every position distributed as p"


def _row(rng, vocab: int, support=None) -> tuple[float, ...]:
    """A distribution in twentieths (plain numbers), on `support` if given."""
    support = np.arange(vocab) if support is None else np.asarray(support)
    counts = np.zeros(vocab, np.int64)
    counts[support] = rng.multinomial(20, rng.dirichlet(np.full(len(support), 0.8)))
    return tuple(float(c / 20) for c in counts)


def _rule_case(what, rng):
    vocab, k = int(rng.integers(3, 7)), int(rng.integers(1, 4))
    seed = int(rng.integers(0, 2**31))
    if what == "no draft":
        return what, (_row(rng, vocab),), None, (), seed
    if what == "p == q":
        p = tuple(_row(rng, vocab) for _ in range(k + 1))
        return what, p, p[:k], None, seed
    if what == "q where p is 0":
        p, q = [], []
        for _ in range(k):
            support = rng.permutation(vocab)[: int(rng.integers(1, vocab))]
            p.append(_row(rng, vocab, support))
            q.append(_row(rng, vocab, np.setdiff1d(np.arange(vocab), support)))
        return what, (*p, _row(rng, vocab)), tuple(q), None, seed
    drafted = tuple(int(t) for t in rng.integers(0, vocab, size=k))
    if what == "point mass where p is 0":
        p = [_row(rng, vocab, np.setdiff1d(np.arange(vocab), [drafted[0]]))]
        return what, (*p, *(_row(rng, vocab) for _ in range(k))), None, drafted, seed
    if what == "point mass p is sure of":
        p = [tuple(float(t == d) for t in range(vocab)) for d in drafted]
        return what, (*p, _row(rng, vocab)), None, drafted, seed
    p = tuple(_row(rng, vocab) for _ in range(k + 1))
    if what == "point masses":
        return what, p, None, drafted, seed
    return what, p, tuple(_row(rng, vocab) for _ in range(k)), None, seed  # "random q"


# ---- exercise 5: speculative sampling, inside the engine -------------------------------------------

@functools.cache
def _models():
    from infra_lab import model

    return model.load("target"), model.load("draft")


def _speculative_engine(rule, gamma: int) -> Engine:
    target, draft = _models()
    backend = serving_backend()
    config = EngineConfig(policy="chunked", max_batch=8, token_budget=128, num_blocks=64, block_size=16,
                          num_speculative_tokens=gamma)
    return Engine(target, config, backend, drafter=ModelDrafter(draft, backend), acceptance_rule=rule)


def _drive_engine(rule, what, *numbers):
    if what == "engine, top-k 1":  # p and q are one-hot: a correct rule gives the target's greedy tokens
        prompts, gamma, max_tokens = numbers
        engine = _speculative_engine(rule, gamma)
        outputs = engine.generate(list(prompts), [SamplingParams(temperature=1.0, top_k=1, seed=i, max_tokens=m)
                                                  for i, m in enumerate(max_tokens)])
        # each byte token as one character (latin-1: lossless), so a failure line reads as text
        return what, *((f"request {i} text", bytes(out).decode("latin-1")) for i, out in enumerate(outputs))
    prompt, gamma, top_k, samples, seed = numbers  # "engine, first two tokens"
    target, draft = _models()
    backend, tokens = serving_backend(), list(prompt.encode())
    params = SamplingParams(temperature=1.0, top_k=top_k)
    first, joint = exactness.exact_first_two(target, tokens, params, backend)
    served = exactness.engine_first_two(target, ModelDrafter(draft, backend), tokens, gamma, params, samples, rule,
                                        seed=seed, backend=backend)
    one, two = exactness.fit(served[:, 0], first), exactness.fit(served[:, 0] * len(first) + served[:, 1], joint)
    if one.p_value < P_MIN or two.p_value < P_MIN:
        bad, which = (one, "first tokens") if one.p_value < P_MIN else (two, "first two tokens")
        if bad is one:
            q = distribution(draft.forward(tokens, None, backend)[-1], 1.0, top_k)  # the drafter's first row
            hint = _hint(served[:, 0], first, q)
        else:
            hint = "the first tokens fit, so look at the positions after the first, and the token after the last draft"
        raise WrongVerdicts(
            f"served through the engine (gamma {gamma}, temperature 1, top-k {top_k}), the {which} of {samples} "
            f"requests for the prompt {prompt!r} do not follow the target's distribution: chi-square p = "
            f"{bad.p_value:.1e}, total variation {bad.total_variation:.2f}; {hint}")
    return what, f"{samples} requests", "first token and first two fit the target's distribution"


def _engine_case(what, rng):
    if what == "engine, top-k 1":
        n = int(rng.integers(2, 4))
        prompts = tuple(str(rng.choice(["def ", "import os", "for i in ", "class A", "return self.", "x = ["]))
                        for _ in range(n))
        return what, (prompts, int(rng.integers(1, 5)), tuple(int(m) for m in rng.integers(3, 9, size=n))), None, \
            None, 0
    prompt = str(rng.choice(ENGINE_PROMPTS))
    return what, (prompt, 2, 4, ENGINE_SAMPLES, int(rng.integers(0, 10_000))), None, None, 0


def _sampling_case(what, rng):
    return _engine_case(what, rng) if what.startswith("engine") else _rule_case(what, rng)


_SAMPLING_KINDS = ["p == q", "q where p is 0", "random q", "point masses", "random q", "no draft",
                   "point mass where p is 0", "random q", "point masses", "random q", "point mass p is sure of",
                   "random q", "p == q", "random q", "q where p is 0", "random q", "point masses", "random q",
                   "random q", "random q", "engine, top-k 1", "engine, top-k 1", "engine, top-k 1",
                   "engine, first two tokens"]


register(Check("ch07.expected_tokens", expected_tokens, Schedule(_EXPECTED_KINDS, _expected_case), rtol=1e-9,
               atol=1e-12))
register(Check("ch07.best_gamma", best_gamma, Schedule(_BEST_KINDS, _best_case), rtol=0, atol=0))
register(Check("ch07.verify_greedy", verify_greedy, Schedule(_GREEDY_KINDS, _greedy_case), drive=drive_greedy,
               rtol=0, atol=0))
register(Check("ch07.rollback", rollback, Schedule(_ROLLBACK_KINDS, _rollback_case), drive=drive_rollback, rtol=0,
               atol=0))
register(Check("ch07.accept_sampling", accept_sampling, Schedule(_SAMPLING_KINDS, _sampling_case),
               drive=drive_sampling, rtol=0, atol=0))
