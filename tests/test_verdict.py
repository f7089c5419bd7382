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
    assert page.startswith("**Verdict: holds.** The article “拒绝GPU空转！")
    assert "(No more idle GPUs! How AI Infra squeezes the last FLOP out of the silicon) claims that speculative " \
           "decoding speeds generation 2 to 3×. Target: at least 2.00×" in page
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
    a = verdict.evidence(results, {"median": 2.0, "low": 1.9, "high": 2.2})
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


def test_one_run_says_so_and_has_no_interval():
    found = verdict.one_run(RUN, 1.13)
    assert (found.low, found.median, found.high) == (1.13, 1.13, 1.13)
    claim = verdict.Claim("balancing keeps loads within 15%", "A", 1.15, "at most", digits=3)
    page = verdict.verdict(claim, found)
    assert page.startswith("**Verdict: holds.** The article “AI Infra深度解析") and "1.130× (one run: no interval)" in page
    own = verdict.Claim("the kernel runs 3× as fast", "this book's target for its kernels", 3.0, "at least")
    assert verdict.verdict(own, found).startswith(
        "**Verdict: does not hold.** This book's target for its kernels: the kernel runs 3× as fast. Target: at least")


def test_the_interval_states_its_real_confidence():
    """Brute force: the chance that the benchmarks' interval misses the median, by enumerating
    which of the rounds fall below it (each does with probability 1/2)."""
    import itertools
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from engine_core import median_interval

    for n in (3, 5, 6, 7, 9, 15, 21):
        lo, hi = median_interval(list(range(n)))  # ranks: the interval is [x_lo, x_hi]
        misses = sum(1 for below in itertools.product((0, 1), repeat=n)
                     if sum(below) <= lo or sum(below) >= hi + 1)  # the median lies outside
        assert verdict.median_coverage(n) == pytest.approx(1 - misses / 2 ** n), n
    assert verdict.median_coverage(3) == 0.75 and verdict.median_coverage(15) > 0.95
    three = verdict.evidence(RUN, {"median": 2.85, "low": 2.5, "high": 3.53, "rounds": [2.5, 2.85, 3.53]})
    assert "(median; 75% interval 2.50× to 3.53×)" in verdict.verdict(AT_LEAST, three)
    serving = verdict.evidence(RUN, {"median": 1.15, "interval_95": [1.13, 1.21],
                                     "per_round": [1.13, 1.21, 1.15]})  # serving.json's form
    assert serving.confidence == 0.75


def test_evidence_names_the_machine_of_its_section():
    results = {**RUN, "machine": "AMD EPYC, 2 threads",
               "kept_runs": {"speed": dict(RUN)}, "kept_from_earlier": {"speed": RUN["command"]}}
    figure = {"median": 2.0, "low": 1.9, "high": 2.2}
    assert verdict.evidence(results, figure, "speed").machine == RUN["machine"]
    assert verdict.evidence(results, figure, "other").machine == "AMD EPYC, 2 threads"
    assert verdict.one_run(results, 1.1, "speed").machine == RUN["machine"]
