"""The one rule behind every verdict in the book (infra_lab.verdict): an interval on the target's
side holds, one on the other side does not, one that straddles it is inconclusive; checked
against a brute-force reading of the rule on random intervals."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra_lab import backend, verdict

AT_LEAST = verdict.Claim("speculative decoding speeds generation 2 to 3×", "C", 2.0, "at least")
AT_MOST = verdict.Claim("communication takes at most 15% of a step", "A", 0.15, "at most", unit="%", digits=0)
RUN = dict(machine="Intel(R) Xeon(R) Processor, 2 threads", measured_on="2026-12-01",
           command="python benchmarks/speculative.py")


@pytest.mark.parametrize("low, high, said", [
    (2.09, 2.85, "holds"), (2.0, 2.1, "holds"),  # reaching the target counts
    (1.5, 1.98, "does not hold"),
    (1.9, 2.1, "inconclusive here"), (1.9, 2.0, "inconclusive here"),
])
def test_at_least_on_both_sides_and_straddling(low, high, said):
    assert verdict.judge(AT_LEAST, low, high) == said


@pytest.mark.parametrize("low, high, said", [
    (0.10, 0.14, "holds"), (0.20, 0.24, "does not hold"), (0.14, 0.16, "inconclusive here"),
    (0.15, 0.15, "holds"),
])
def test_at_most_on_both_sides_and_straddling(low, high, said):
    assert verdict.judge(AT_MOST, low, high) == said


finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(finite, finite, finite, st.sampled_from(verdict.DIRECTIONS))
def test_the_rule_against_every_point_of_the_interval(a, b, target, direction):
    """Brute force: the claim holds at a point when it is on the target's side; the verdict is
    "holds" when it holds at both ends (so at every point between), "does not hold" when at
    neither, else inconclusive."""
    low, high = min(a, b), max(a, b)
    claim = verdict.Claim("x", "A", target, direction)
    at = (lambda v: v >= target) if direction == "at least" else (lambda v: v <= target)
    expected = "holds" if at(low) and at(high) else "does not hold" if not (at(low) or at(high)) else "inconclusive here"
    assert verdict.judge(claim, low, high) == expected


def test_a_narrow_interval_never_flips_with_a_live_figure():
    found = verdict.Evidence(2.85, 2.7, 3.0, **RUN)
    page = verdict.verdict(AT_LEAST, found)
    assert page.startswith("**Verdict: holds.** Speculative decoding speeds generation 2 to 3× (the article ")
    assert "No more idle GPUs!" in page and "Target: at least 2.00×" in page
    assert "2.85× (median; 95% interval 2.70× to 3.00×)" in page
    assert "Intel(R) Xeon(R) Processor, 2 threads, 2026-12-01 (`python benchmarks/speculative.py`)" in page
    said = verdict.live(AT_LEAST, 1.98)
    assert said.startswith(f"This page's live run measured 1.98× on {backend.machine()}")
    assert "holds" not in said and "not hold" not in said


def test_percent_claims_print_percent():
    found = verdict.Evidence(0.14, 0.12, 0.145, **RUN)
    assert "Target: at most 15%. The committed benchmark run measured 14% (median; 95% interval 12% to 14%)" \
        in verdict.verdict(AT_MOST, found)


def test_evidence_reads_both_forms_the_benchmarks_write():
    results = dict(RUN)
    a = verdict.evidence(results, {"median": 2.0, "low": 1.9, "high": 2.2, "rounds": [1.9, 2.0, 2.2]})
    b = verdict.evidence(results, {"median": 2.0, "interval_95": [1.9, 2.2]})
    assert a == b == verdict.Evidence(2.0, 1.9, 2.2, **RUN)
    with pytest.raises(ValueError, match=r"median and 95% interval .* got keys \['median'\]"):
        verdict.evidence(results, {"median": 2.0})


@pytest.mark.parametrize("bad, message", [
    (dict(median=3.0, low=1.0, high=2.0), "must hold its median 3.0"),
    (dict(median=math.nan, low=1.0, high=2.0), "must be finite"),
    (dict(median=1.5, low=1.0, high=2.0, machine=""), "names its machine"),
    (dict(median=1.5, low=1.0, high=2.0, measured_on="yesterday"), "Invalid isoformat"),
])
def test_bad_evidence_is_named(bad, message):
    with pytest.raises(ValueError, match=message):
        verdict.Evidence(**(RUN | bad))


def test_bad_claims_and_intervals_are_named():
    with pytest.raises(ValueError, match="direction must be one of at least, at most; got 'above'"):
        verdict.Claim("x", "A", 1.0, "above")
    with pytest.raises(ValueError, match="finite number; got nan"):
        verdict.Claim("x", "A", math.nan, "at least")
    with pytest.raises(ValueError, match=r"finite low <= high; got \[2.0, 1.0\]"):
        verdict.judge(AT_LEAST, 2.0, 1.0)
    with pytest.raises(ValueError, match="live figure must be finite; got inf"):
        verdict.live(AT_LEAST, math.inf)
