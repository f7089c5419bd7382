"""Is speculative sampling exact? A statistical test in the engine (chapter 07).

Speculative sampling promises that every token it emits is distributed as the target's own
sample (Leviathan et al., 2023, appendix A.1; Chen et al., 2023, theorem 1). The test: serve
many requests with one prompt and different seeds through the engine with speculation, record
the first two tokens of each, and compare their counts with the target's exact probabilities
p(x1 | prompt) and p(x1 | prompt) p(x2 | prompt, x1) by Pearson's chi-square, the rarest outcomes
pooled into one bin expected at least 5 times. Each request's first step drafts γ tokens after
its prompt, so both tokens come out of speculative rounds. A rule that keeps every draft emits the drafter's
distribution instead, and the same test rejects it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra_lab import backend as backends
from infra_lab.model.generate import distribution
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.drafters import Drafter
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams


@dataclass(frozen=True)
class FitTest:
    chi_square: float
    dof: int
    p_value: float
    total_variation: float  # half the L1 distance between the observed and exact distributions
    samples: int
    bins: int  # after merging sparse ones


def exact_first_two(target, prompt: list[int], params: SamplingParams,
                    backend: backends.Backend | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The target's exact p(x1) (vocab,) and joint p(x1, x2) (vocab, vocab) after `prompt`."""
    backend = backend or backends.current()
    warp = lambda logits: distribution(logits, params.temperature, params.top_k, params.top_p)  # noqa: E731
    first = warp(target.forward(prompt, None, backend)[-1])
    joint = np.zeros((len(first), len(first)))
    for x1 in np.flatnonzero(first):
        joint[x1] = first[x1] * warp(target.forward([*prompt, int(x1)], None, backend)[-1])
    return first, joint


def engine_first_two(target, drafter: Drafter, prompt: list[int], gamma: int, params: SamplingParams,
                     samples: int, rule=None, max_batch: int = 64, seed: int = 0,
                     backend: backends.Backend | None = None) -> np.ndarray:
    """(samples, 2): the first two tokens of `samples` requests for `prompt`, each with its own
    seed, served by the engine with speculative decoding (γ drafts, `rule` to accept them)."""
    config = EngineConfig(policy="chunked", max_batch=max_batch, token_budget=max_batch * (len(prompt) + gamma + 1),
                          num_blocks=max_batch * (-(-(len(prompt) + gamma + 2) // 16)) + 8,
                          num_speculative_tokens=gamma)
    engine = Engine(target, config, backend, drafter=drafter, acceptance_rule=rule)
    first = []
    for start in range(0, samples, max_batch):  # one wave at a time: the pool holds max_batch requests
        count = min(max_batch, samples - start)
        waves = [SamplingParams(params.temperature, params.top_k, params.top_p, seed * samples + start + i,
                                gamma + 1)
                 for i in range(count)]
        first += [output[:2] for output in engine.generate([prompt] * count, waves)]
    return np.array(first, np.int64)


def fit(observed: np.ndarray, expected: np.ndarray) -> FitTest:
    """Pearson's chi-square of observed outcome indices against exact probabilities (any shape,
    flattened). Outcomes expected under 5 times are pooled into one bin, with the next rarest
    while that bin is still expected under 5 times (Cochran's rule: a bin expected 0.01 times
    that happens once would otherwise add 98 to the chi-square of a faithful sampler);
    outcomes of probability 0 that occur make the test fail outright (p = 0)."""
    expected = np.asarray(expected, np.float64).ravel()
    observed = np.asarray(observed).ravel()
    if not np.isfinite(expected).all() or (expected < 0).any() or not np.isclose(expected.sum(), 1, atol=1e-5):
        raise ValueError(f"expected must be probabilities (non-negative, summing to 1); they sum to {expected.sum()}")
    if len(observed) == 0 or observed.min() < 0 or observed.max() >= len(expected):
        raise ValueError(f"need at least one observed outcome, each an index in [0, {len(expected)})")
    n = len(observed)
    counts = np.bincount(observed, minlength=len(expected)).astype(np.float64)
    tv = 0.5 * np.abs(counts / n - expected).sum()
    impossible = counts[expected == 0].sum()
    possible = np.flatnonzero(expected > 0)
    rarest = possible[np.argsort(expected[possible], kind="stable")]  # rarest first
    sparse = int((expected[rarest] * n < 5).sum())  # a prefix of rarest
    pooled = min(max(sparse, int(np.searchsorted(np.cumsum(expected[rarest]) * n, 5)) + 1), len(rarest))
    observed_bins = np.append(counts[rarest[:pooled]].sum(), counts[rarest[pooled:]])
    expected_bins = np.append(expected[rarest[:pooled]].sum(), expected[rarest[pooled:]]) * n
    from scipy import stats  # here, as simulator.py imports scipy: not on the import path of the package

    chi = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    dof = len(expected_bins) - 1
    p_value = 0.0 if impossible else float(stats.chi2.sf(chi, dof)) if dof > 0 else 1.0
    return FitTest(chi, dof, p_value, float(tv), n, len(expected_bins))


def test_first_two(target, drafter: Drafter, prompt: list[int], gamma: int, params: SamplingParams,
                   samples: int, rule=None, backend: backends.Backend | None = None,
                   seed: int = 0) -> tuple[FitTest, FitTest]:
    """The fit of the first token, and of the first two, from the engine against the target."""
    first, joint = exact_first_two(target, prompt, params, backend)
    tokens = engine_first_two(target, drafter, prompt, gamma, params, samples, rule, seed=seed, backend=backend)
    return fit(tokens[:, 0], first), fit(tokens[:, 0] * len(first) + tokens[:, 1], joint)


test_first_two.__test__ = False  # a function for the chapter and the benchmark, not for pytest to collect
