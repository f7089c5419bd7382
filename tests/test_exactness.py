"""The chi-square test of chapter 07 (serving.exactness): it passes draws from the distribution it
is given, rejects draws from another, pools rare outcomes so that a faithful sampler is not
rejected for one rare draw, fails outright on an impossible outcome; in the engine it passes
speculative sampling and rejects a rule that keeps every draft."""
import numpy as np
import pytest
from scipy import stats

from infra_lab import backend as backends
from infra_lab.model.transformer import load
from infra_lab.serving.drafters import ModelDrafter
from infra_lab.serving.exactness import exact_first_two, fit, test_first_two
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.speculative import accept_all
from infra_lab.serving.traffic import stdlib_prompts

KNOWN = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draws_from_the_distribution_pass(seed):
    draws = np.random.default_rng(seed).choice(len(KNOWN), 20_000, p=KNOWN)
    result = fit(draws, KNOWN)
    assert result.p_value >= 0.01
    assert result.samples == 20_000 and result.bins == len(KNOWN) and result.dof == len(KNOWN) - 1
    assert result.total_variation < 0.02


def test_draws_from_another_distribution_fail():
    other = KNOWN[::-1].copy()
    draws = np.random.default_rng(0).choice(len(KNOWN), 20_000, p=other)
    result = fit(draws, KNOWN)
    assert result.p_value < 1e-6
    assert result.total_variation == pytest.approx(0.5 * np.abs(other - KNOWN).sum(), abs=0.02)
    slightly = 0.9 * KNOWN + 0.1 * other  # a tenth of the mass misplaced is still caught
    assert fit(np.random.default_rng(1).choice(len(KNOWN), 20_000, p=slightly), KNOWN).p_value < 1e-6


def test_the_statistic_is_pearsons_on_the_bins():
    observed = np.repeat(np.arange(3), [30, 50, 20])
    expected = np.array([0.25, 0.5, 0.25])
    result = fit(observed, expected)
    reference = stats.chisquare([30, 50, 20], [25, 50, 25])
    assert result.chi_square == pytest.approx(reference.statistic) and result.p_value == pytest.approx(reference.pvalue)
    assert result.total_variation == pytest.approx(0.05)


def test_outcomes_expected_under_five_times_are_pooled():
    """n = 100: 3 and 2 are expected under 5 times, pooled into one bin of 5."""
    expected = np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    observed = np.repeat(np.arange(6), [50, 30, 10, 5, 1, 4])
    result = fit(observed, expected)
    assert result.bins == 5 and result.dof == 4
    reference = stats.chisquare([50, 30, 10, 5, 5], [50, 30, 10, 5, 5])
    assert result.chi_square == pytest.approx(reference.statistic) == 0


def test_a_rare_outcome_seen_once_does_not_reject_a_faithful_sampler():
    """p = 1e-5 over 1,000 draws: seen once with probability 1%, and then no evidence against the
    sampler. Pooled alone its bin would be expected 0.01 times: chi-square 98, p ~ 1e-22. Pooled
    with the next rarest until expected 5 times, the fit is perfect."""
    expected = np.array([0.5, 0.5 - 1e-5, 1e-5])
    observed = np.repeat(np.arange(3), [500, 499, 1])
    result = fit(observed, expected)
    assert result.bins == 2 and result.p_value > 0.5


def test_an_impossible_outcome_fails_outright():
    expected = np.array([0.5, 0.5, 0.0])
    observed = np.repeat(np.arange(3), [5000, 4999, 1])
    assert fit(observed, expected).p_value == 0
    assert fit(observed[:-1], expected).p_value > 0.5  # without it, a perfect fit


def test_joint_outcomes_are_flattened():
    joint = np.array([[0.3, 0.2], [0.1, 0.4]])
    draws = np.random.default_rng(3).choice(4, 5000, p=joint.ravel())
    assert fit(draws, joint).p_value >= 0.01 and fit(draws, joint.T).p_value < 1e-6


@pytest.mark.parametrize("observed, expected, message", [
    (np.array([0, 1]), np.array([0.5, 0.6]), "expected must be probabilities"),
    (np.array([0, 1]), np.array([1.5, -0.5]), "expected must be probabilities"),
    (np.array([0, 3]), np.array([0.5, 0.5]), r"each an index in \[0, 2\)"),
    (np.array([], np.int64), np.array([0.5, 0.5]), "at least one observed outcome"),
])
def test_bad_input_to_fit_is_refused(observed, expected, message):
    with pytest.raises(ValueError, match=message):
        fit(observed, expected)


# ---- in the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    return load("target"), load("draft")


def test_exact_first_two_is_the_targets_joint_distribution(models):
    target, _ = models
    backend, prompt = backends.resolve("torch"), stdlib_prompts([12], seed=0)[0]
    params = SamplingParams(temperature=0.7, top_k=5)
    first, joint = exact_first_two(target, prompt, params, backend)
    assert first.sum() == pytest.approx(1) and (first > 0).sum() == 5  # top-k: five tokens possible
    assert joint.sum() == pytest.approx(1) and joint.sum(axis=1) == pytest.approx(first)
    assert ((joint > 0).sum(axis=1) == 5 * (first > 0)).all()


@pytest.mark.slow
def test_the_engine_passes_speculative_sampling_and_rejects_accept_all(models):
    """γ = 3, temperature 1: 1,000 requests through the engine fit the target's exact p(x1) and
    p(x1, x2); a rule that keeps every draft emits the drafter's tokens and fails. The threshold
    1e-3 fails a correct rule once in a thousand seeds; the seed is fixed, so the test is
    deterministic."""
    target, draft = models
    backend, prompt = backends.resolve("torch"), stdlib_prompts([24], seed=0)[0]
    params = SamplingParams(temperature=1.0)
    one, two = test_first_two(target, ModelDrafter(draft, backend=backend), prompt, 3, params, 1000,
                              backend=backend, seed=1)
    assert one.samples == two.samples == 1000 and one.bins > 5 and two.bins > 5
    assert one.p_value >= 1e-3 and two.p_value >= 1e-3, (one, two)
    one, two = test_first_two(target, ModelDrafter(draft, backend=backend), prompt, 3, params, 300, rule=accept_all,
                              backend=backend)
    assert one.p_value < 1e-6 and two.p_value < 1e-6, (one, two)
