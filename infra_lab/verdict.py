"""Verdicts on the articles' claims: one rule for every chapter, from a committed benchmark run.

A claim the book tests ("speculative decoding speeds generation 2 to 3×") comes with a target
(at least 2×) and is judged from a benchmark run kept in benchmarks/results/: the median of its
rounds with a 95% interval for that median, the machine it ran on and the date. The verdict is

- "holds" when the whole interval lies on the target's side,
- "does not hold" when the whole interval lies on the other side,
- "inconclusive here" when the interval straddles the target.

A chapter's live run on the reader's machine is shown beside the verdict with `live`, labelled
with that machine; it never changes the verdict, since one short run cannot narrow the interval.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

from infra_lab import backend

VERDICTS = ("holds", "does not hold", "inconclusive here")
DIRECTIONS = ("at least", "at most")
# The three articles whose claims the book tests (original title, then English), by key
ARTICLES = {
    "A": "“AI Infra深度解析：掌握六大核心要素，洞悉技术演进趋势” (AI Infra in depth: six core "
         "elements and where the technology is going)",
    "B": "“行业杂谈 | AI Infra深度解析：从算力底座到智能应用的技术桥梁” (Industry notes: AI Infra in "
         "depth, the bridge from compute to applications)",
    "C": "“拒绝GPU空转！深入解读AI Infra如何榨干硅的算力极限” (No more idle GPUs! How AI Infra squeezes "
         "the last FLOP out of the silicon)",
}


@dataclass(frozen=True)
class Claim:
    """What an article says, and the target a measurement must reach for it to hold."""
    statement: str  # the claim as the page states it: "speculative decoding speeds generation 2 to 3×"
    source: str  # "A", "B" or "C" (ARTICLES), or a paper's citation
    target: float  # the value the measurement must reach
    direction: str  # "at least" or "at most": which side of the target holds the claim
    unit: str = "×"  # printed after each figure: "×", "%", " ms"
    digits: int = 2  # decimals printed

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}; got {self.direction!r}")
        if not math.isfinite(self.target):
            raise ValueError(f"the target must be a finite number; got {self.target!r}")
        if not self.statement.strip():
            raise ValueError("a claim needs its statement")

    def cited(self) -> str:
        return f"the article {ARTICLES[self.source]}" if self.source in ARTICLES else self.source

    def figure(self, value: float) -> str:
        if self.unit == "%":
            return f"{100 * value:.{self.digits}f}%"
        return f"{value:.{self.digits}f}{self.unit}"


@dataclass(frozen=True)
class Evidence:
    """A committed benchmark figure: the median of its rounds and a 95% interval for it."""
    median: float
    low: float
    high: float
    machine: str  # "Intel(R) Xeon(R) Processor, 2 threads"
    measured_on: str  # ISO date
    command: str  # what produced it: "python benchmarks/speculative.py"

    def __post_init__(self):
        if not all(math.isfinite(x) for x in (self.median, self.low, self.high)):
            raise ValueError(f"a median and its interval must be finite; got {self.median!r} in "
                             f"[{self.low!r}, {self.high!r}]")
        if not self.low <= self.median <= self.high:
            raise ValueError(f"the interval [{self.low!r}, {self.high!r}] must hold its median {self.median!r}")
        if not self.machine or not self.measured_on or not self.command:
            raise ValueError("evidence names its machine, its date and the command that measured it")
        datetime.date.fromisoformat(self.measured_on)  # raises ValueError on a malformed date


def evidence(results: dict, figure: dict) -> Evidence:
    """Evidence from a loaded results file (infra_lab.measured.load) and one of its figures: a
    dict with "median" and either "low" and "high" or "interval_95" (the benchmarks' two forms)."""
    if "low" in figure and "high" in figure:
        low, high = figure["low"], figure["high"]
    elif "interval_95" in figure:
        low, high = figure["interval_95"]
    else:
        raise ValueError(f"a figure needs its median and 95% interval ('low' and 'high', or 'interval_95'); "
                         f"got keys {sorted(figure)}")
    return Evidence(float(figure["median"]), float(low), float(high), results["machine"],
                    results["measured_on"], results["command"])


def judge(claim: Claim, low: float, high: float) -> str:
    """One of VERDICTS: where the interval [low, high] lies against the claim's target."""
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise ValueError(f"an interval needs finite low <= high; got [{low!r}, {high!r}]")
    if claim.direction == "at least":
        return "holds" if low >= claim.target else "does not hold" if high < claim.target else "inconclusive here"
    return "holds" if high <= claim.target else "does not hold" if low > claim.target else "inconclusive here"


def verdict(claim: Claim, found: Evidence) -> str:
    """The verdict as a Markdown paragraph: the claim, its source, the target, the benchmark's
    median and interval, and the machine, date and command of the run."""
    said = judge(claim, found.low, found.high)
    return (f"**Verdict: {said}.** {claim.statement[0].upper() + claim.statement[1:]} ({claim.cited()}). "
            f"Target: {claim.direction} {claim.figure(claim.target)}. The committed benchmark run measured "
            f"{claim.figure(found.median)} (median; 95% interval {claim.figure(found.low)} to "
            f"{claim.figure(found.high)}) on {found.machine}, {found.measured_on} (`{found.command}`).")


def live(claim: Claim, value: float, what: str = "this page's live run") -> str:
    """The reader's own figure, labelled with their machine, as a sentence beside the verdict."""
    if not math.isfinite(value):
        raise ValueError(f"a live figure must be finite; got {value!r}")
    return (f"{what[0].upper() + what[1:]} measured {claim.figure(value)} on {backend.machine()}: one "
            "short run, shown for comparison; the verdict rests on the benchmark's interval.")
